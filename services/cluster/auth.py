"""Token authentication between the Ray head ``inflight pool deploy`` starts and its clients.

Ray 2.60 (measured): ``ray start --head`` turns token authentication on as soon as it finds a
token (any earlier local ``ray.init`` leaves one in ``~/.ray/auth_token``), but a client that
names an address never turns it on by itself; it then retries for ~20 s and fails with a
traceback. So Inflight decides for both sides: its head always runs with ``RAY_AUTH_MODE=token``
and a fresh token of its own, written ``0600`` in Inflight's state directory, and every Inflight
client of that head reads the same file (``RAY_AUTH_TOKEN_PATH``). Before ``ray.init`` a client
asks the GCS once (``check_gcs``), so a missing or wrong token is one clear error, not a retry loop.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

TOKEN_FILE = "ray_auth_token"
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
_PROBE_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"


class ClusterConnectError(RuntimeError):
    """The Ray cluster cannot be used from this client (unreachable, or it refuses our token)."""


def write_token(state_dir: Path) -> Path:
    """A new random token (256 bits, as Ray's own generator) in ``state_dir/ray_auth_token``, mode 0600."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = state_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(secrets.token_hex(32))
    return path


def head_env(token_path: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for ``ray start --head`` (and so for every process of that node): token mode, our file."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in AUTH_VARS}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
    return env


def use_token(token_path: Path) -> None:
    """Make this process's Ray client authenticate with the token in ``token_path``."""
    for var in AUTH_VARS:
        os.environ.pop(var, None)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
    # ray/_raylet.pyi lags the compiled module: these names exist in _raylet.so but not in the stub
    from ray._raylet import AuthenticationTokenLoader, Config  # pyright: ignore[reportAttributeAccessIssue]

    Config.initialize("")                          # Ray caches its config (and the auth mode) per process
    AuthenticationTokenLoader.instance().reset_cache()


def client_token() -> str | None:
    """The token this process's Ray client would send (None when its auth mode is not ``token``)."""
    # not in ray/_raylet.pyi (the stub lags the compiled module)
    from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode  # pyright: ignore[reportAttributeAccessIssue]

    loader = AuthenticationTokenLoader.instance()
    if get_authentication_mode() != AuthenticationMode.TOKEN or not loader.has_token():
        return None
    return loader.get_raw_token()


def check_gcs(address: str, token: str | None, timeout_s: float = 10.0, hint: str = "") -> None:
    """Ask the GCS at ``address`` once, with ``token``; raise ``ClusterConnectError`` (one line) if it refuses."""
    import grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(_PROBE_METHOD, request_serializer=None, response_deserializer=None)
        try:
            call(b"", timeout=timeout_s, metadata=metadata, wait_for_ready=True)
            return
        except grpc.RpcError as err:
            code = err.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        what = "a token this client does not have" if token is None else "a different token than this client's"
        raise ClusterConnectError(
            f"Ray cluster at {address} requires {what}. {hint or _HINT}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        raise ClusterConnectError(f"no Ray cluster answers at {address} (waited {timeout_s:.0f} s). "
                                  f"{hint or 'Check RAY_ADDRESS, or run `inflight pool deploy`.'}")
    # Any other answer means the GCS is there and let us in; ray.init reports what else is wrong.


_HINT = ("For the head `inflight pool deploy` started, run with the same INFLIGHT_HOME (its token is "
         "INFLIGHT_HOME/ray_auth_token); for another cluster set RAY_AUTH_MODE=token and "
         "RAY_AUTH_TOKEN_PATH=<file holding that cluster's token>.")
