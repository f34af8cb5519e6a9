"""A pool's route prefix (``rollout_pool.route_prefix``): the base URL deploy answers with, and the status page's
links, which must stay under the prefix so that several pools can serve side by side on one Serve proxy."""
from __future__ import annotations

import re

from services.pool import pool_url
from services.pool.status_page import render_page
from services.recipe.config import load_recipe


def test_the_default_prefix_is_the_proxy_root():
    assert load_recipe(None, []).rollout_pool.route_prefix == "/"
    assert pool_url("127.0.0.1", 8123, "/") == "http://127.0.0.1:8123"


def test_a_prefixed_pool_answers_under_its_prefix():
    recipe = load_recipe(None, ["rollout_pool.route_prefix=/pools/a"])
    assert pool_url("10.0.0.2", 9000, recipe.rollout_pool.route_prefix) == "http://10.0.0.2:9000/pools/a"


def links(html: str) -> list[str]:
    return re.findall(r'<a href="([^"]+)">', html)


def test_the_status_page_links_stay_under_the_prefix():
    status = {"name": "p", "version": 1, "ready": True}
    assert links(render_page(status, [], {}, now=0.0)) == ["/v1/status", "/v1/history", "/metrics"]
    assert links(render_page(status, [], {}, now=0.0, route_prefix="/pools/a")) == [
        "/pools/a/v1/status", "/pools/a/v1/history", "/pools/a/metrics"]
