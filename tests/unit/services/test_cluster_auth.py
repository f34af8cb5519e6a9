"""Token handling between Inflight's Ray head and its clients (``services.cluster.auth``).

``check_gcs`` is exercised against a small gRPC server that answers the GCS method the way
Ray 2.60's token interceptor does: UNAUTHENTICATED unless ``authorization: Bearer <token>``.
"""
from __future__ import annotations

import json
import stat
import time
from concurrent import futures

import grpc
import pytest

from services.cluster import head as cluster


from services.cluster import auth as cluster_auth
TOKEN = "s3cret" * 8


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_HOME", str(tmp_path / "inflight"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path / "inflight"


def test_token_file_is_private_and_fresh(home):
    first = cluster_auth.write_token(home)
    again = cluster_auth.write_token(home)
    assert first == again == home / "ray_auth_token"
    assert stat.S_IMODE(first.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert len(first.read_text()) == 64


def test_head_env_forces_token_mode_with_our_file(home):
    path = home / "ray_auth_token"
    env = cluster_auth.head_env(path, {"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "other", "PATH": "/bin"})
    assert env == {"PATH": "/bin", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}


def test_token_is_handed_only_to_the_recorded_head(home):
    home.mkdir(parents=True)
    cluster.state_file().write_text(json.dumps({"address": "127.0.0.1:6390", "temp_dir": "/tmp/x",
                                                "token_path": str(home / "ray_auth_token")}))
    assert cluster.token_for("127.0.0.1:6390") == home / "ray_auth_token"
    assert cluster.token_for("localhost:6390") == home / "ray_auth_token"
    assert cluster.token_for("127.0.0.1:6391") is None
    assert cluster.token_for("203.0.113.9:6390") is None          # another machine never gets our token


class _Gcs(grpc.GenericRpcHandler):
    def service(self, details):
        if details.method != "/ray.rpc.NodeInfoGcsService/GetClusterId":
            return None

        def answer(request, context):
            if dict(context.invocation_metadata()).get("authorization") != f"Bearer {TOKEN}":
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken")
            return b""
        return grpc.unary_unary_rpc_method_handler(answer)


@pytest.fixture
def gcs():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((_Gcs(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_right_token_passes(gcs):
    cluster_auth.check_gcs(gcs, TOKEN)


@pytest.mark.parametrize("token, says", [(None, "a token this client does not have"),
                                         ("wrong", "a different token")])
def test_missing_or_wrong_token_is_one_clear_line_at_once(gcs, token, says):
    t0 = time.monotonic()
    with pytest.raises(cluster_auth.ClusterConnectError) as err:
        cluster_auth.check_gcs(gcs, token)
    assert time.monotonic() - t0 < 5
    msg = str(err.value)
    assert says in msg and gcs in msg and "RAY_AUTH_TOKEN_PATH" in msg and "\n" not in msg


def test_nobody_listening_is_a_clear_error():
    with pytest.raises(cluster_auth.ClusterConnectError, match="no Ray cluster answers"):
        cluster_auth.check_gcs(f"127.0.0.1:{cluster.free_port()}", None, timeout_s=1)
