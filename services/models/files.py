"""Model files on every node: shipped through Ray when a node does not have them.

:func:`share` (on the driver) starts a :class:`ModelFileHolder` actor pinned to
the driver's node that keeps every file of the model directory open and hashes
them on first use. :func:`ensure_local` (in an engine or learner actor) returns
the directory when its node has it (trusted to be the same model), else copies
the holder's files in chunks into ``$INFLIGHT_CACHE/models/<content hash>`` on
its own node, once per node and content, each file checked against its
SHA-256. When nothing can ship them, :class:`ModelFilesError` names this node,
the origin node and the path. More: docs/operations.md, "Model files".
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

log = logging.getLogger("inflight.model_files")
CHUNK_BYTES = 64 * 1024 * 1024
"""Bytes per read from the holder (one object in the store at a time per reader)."""
CALL_TIMEOUT_S = 600.0
"""Longest one holder call (hashing a large model, reading a chunk) may take."""
COMPLETE = ".inflight-complete"
"""Marker written last into a materialized directory."""


class ModelFilesError(RuntimeError):
    """The model directory is not on this node and cannot be shipped to it."""


@dataclass(frozen=True)
class ModelFiles:
    """A model directory and where it can be copied from."""

    path: str
    """The directory on the origin node (used as is on any node that has it)."""
    node_id: str
    """Ray node id of the origin node."""
    node_ip: str
    """IP of the origin node (for error messages)."""
    holder: Any = None
    """ActorHandle of the :class:`ModelFileHolder` on the origin node; None: nothing ships the files."""


def _files_of(root: Path) -> list[str]:
    """Regular files under ``root`` (relative, sorted), without hidden entries (``.cache``, ``.git``)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if not name.startswith("."):
                out.append(str((Path(dirpath) / name).relative_to(root)))
    return sorted(out)


class ModelFileHolder:
    """Keeps a model directory's files open on its node and serves their bytes (a Ray actor)."""

    def __init__(self, path: str):
        root = Path(path)
        if not (root / "config.json").is_file():
            raise ModelFilesError(f"model files: {path} on node {_node_ip()} is not a model directory "
                                  f"(no config.json)")
        self.path = path
        self._fds = {rel: os.open(root / rel, os.O_RDONLY) for rel in _files_of(root)}
        self._manifest: dict | None = None
        self._lock = threading.Lock()

    def source(self) -> str:
        return self.path

    def manifest(self) -> dict:
        """``{"digest", "files": [[rel, size, sha256], ...]}``; hashed once, on the first call."""
        with self._lock:
            if self._manifest is None:
                files, total = [], hashlib.sha256()
                for rel, fd in self._fds.items():
                    size, sha = _hash_fd(fd)
                    files.append([rel, size, sha])
                    total.update(f"{rel}\0{size}\0{sha}\n".encode())
                self._manifest = {"digest": total.hexdigest(), "files": files}
            return self._manifest

    def read(self, rel: str, offset: int, length: int) -> bytes:
        return os.pread(self._fds[rel], length, offset)


def _hash_fd(fd: int) -> tuple[int, str]:
    h, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, CHUNK_BYTES, offset):
        h.update(chunk)
        offset += len(chunk)
    return offset, h.hexdigest()


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def holder_name(owner: str) -> str:
    return f"{owner}-model-files"


def share(path: str, owner: str | None = None) -> ModelFiles:
    """Register ``path`` (a directory on this node) so that actors on other nodes can get its files.

    ``owner`` (a pool name): the holder is a detached actor named after it, which outlives this process
    (``release(owner)`` ends it); None: the holder lives as long as this process."""
    import ray
    from ray.exceptions import RayActorError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    path = str(Path(path).resolve())
    opts: dict = {"num_cpus": 0, "max_restarts": 0, "max_concurrency": 8,
                  "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
    if owner is not None:
        try:
            old = ray.get_actor(holder_name(owner), namespace="inflight")
            if ray.get(old.source.remote(), timeout=60) == path:
                return ModelFiles(path, node_id, _node_ip(), old)
            ray.kill(old)
        except ValueError:
            pass  # none yet
        except RayActorError:
            pass  # a dead one; replaced below
        opts.update(name=holder_name(owner), namespace="inflight", lifetime="detached")
    holder = ray.remote(ModelFileHolder).options(**opts).remote(path)
    ray.get(holder.source.remote(), timeout=120)  # fails here if the directory is not a model
    return ModelFiles(path, node_id, _node_ip(), holder)


def release(owner: str) -> None:
    """End the holder that ``share(..., owner)`` started, if any."""
    import ray

    try:
        ray.kill(ray.get_actor(holder_name(owner), namespace="inflight"))
    except ValueError:
        pass


def ensure_local(model: ModelFiles | str, cache_dir: str | Path | None = None) -> str:
    """A directory on this node with the model's files: ``model.path`` if the node has it, else a copy
    fetched from the holder into ``cache_dir`` (default ``$INFLIGHT_CACHE/models``)."""
    if isinstance(model, str):
        model = ModelFiles(model, "", "")
    if (Path(model.path) / "config.json").is_file():
        return model.path
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    here = f"node {_node_ip()} ({ray.get_runtime_context().get_node_id()[:12]})" if ray.is_initialized() \
        else f"node {_node_ip()}"
    where = f"{model.path} from node {model.node_ip or '?'}"
    if model.holder is None:
        raise ModelFilesError(f"model files: {model.path} is not on {here}, and nothing ships it here "
                              f"(it was not registered with services.models.files.share)")
    if cache_dir is None:
        from services.models.source import CACHE
        cache_dir = CACHE / "models"
    try:
        # handle calls are untyped: cast to what ModelFileHolder.manifest returns
        manifest = cast(dict, ray.get(model.holder.manifest.remote(), timeout=CALL_TIMEOUT_S))
        return _materialize(model.holder, manifest, Path(cache_dir), here)
    except (RayActorError, GetTimeoutError) as exc:
        raise ModelFilesError(f"model files: {model.path} is not on {here} and cannot be shipped: the holder of "
                              f"{where} is gone or did not answer ({type(exc).__name__})") from None


def _materialize(holder, manifest: dict, cache: Path, here: str) -> str:
    """Copy the holder's files into ``cache/<digest>`` (under a file lock; checked; renamed into place)."""
    import ray

    dest = cache / manifest["digest"]
    if (dest / COMPLETE).exists():
        return str(dest)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{manifest['digest']}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks on one node wait for the first one's copy
        if (dest / COMPLETE).exists():
            return str(dest)
        tmp = cache / f".{manifest['digest']}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)  # an incomplete earlier copy
        for rel, size, sha in manifest["files"]:
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            h = hashlib.sha256()
            with open(target, "wb") as f:
                for offset in range(0, size, CHUNK_BYTES):
                    data = cast(bytes, ray.get(holder.read.remote(rel, offset, min(CHUNK_BYTES, size - offset)),
                                               timeout=CALL_TIMEOUT_S))
                    h.update(data)
                    f.write(data)
            if h.hexdigest() != sha:
                shutil.rmtree(tmp, ignore_errors=True)
                raise ModelFilesError(f"model files: {rel} arrived on {here} with SHA-256 {h.hexdigest()[:12]}, "
                                      f"expected {sha[:12]} (changed on the origin node while shipping?)")
        (tmp / COMPLETE).write_text(manifest["digest"])
        os.rename(tmp, dest)
    log.info("model files: %d files (%d bytes) shipped to %s into %s", len(manifest["files"]),
             sum(s for _, s, _ in manifest["files"]), here, dest)
    return str(dest)
