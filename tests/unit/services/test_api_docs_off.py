"""Issue 32.8: neither the pool's HTTP app nor an environment server serves FastAPI's API pages (``/docs`` loads
scripts from a CDN; nobody asked for ``/redoc`` or ``/openapi.json``)."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from services.pool.env_server import environment_app

PAGES = ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")


class Env:
    def reset(self, task):
        return {}, []

    def step(self, state, turn):
        raise NotImplementedError


@pytest.mark.parametrize("path", PAGES)
def test_the_pool_app_does_not_serve_the_api_pages(path):
    from services.pool.deployment import app

    assert TestClient(app).get(path).status_code == 404


@pytest.mark.parametrize("path", PAGES)
def test_an_environment_server_does_not_serve_the_api_pages(path):
    client = TestClient(environment_app(Env(), "e"))
    assert client.get(path).status_code == 404
    assert client.get("/healthz").status_code == 200
