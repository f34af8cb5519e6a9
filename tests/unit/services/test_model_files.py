"""Rendezvous at rank 0's node and model files on nodes without them (logic, with fakes; the real
multi-node runs are tests/integration/services/test_multinode.py)."""
from __future__ import annotations

import hashlib

import pytest

from services.models import files as model_files
from services.recipe.config import load_recipe
from services.job.learner_actor import LearnerActor, LearnerSpec
from services.job.learner_group import start_ranks
from services.models.files import ModelFileHolder, ModelFiles, ModelFilesError, ensure_local


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)  # the "ref" is the value itself


class FakeRank:
    """A learner rank on a node with IP ``ip``: reports that node's address, records its setup."""

    def __init__(self, ip: str, port: int):
        self.got = None
        self.rendezvous_address = _Method(lambda: (ip, port))
        self.setup = _Method(lambda host, p: setattr(self, "got", (host, p)))


def test_ranks_meet_at_the_address_rank_zero_reports_for_its_own_node(monkeypatch):
    import ray

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.1")  # the driver's node
    ranks = [FakeRank("10.0.0.7", 29517), FakeRank("10.0.0.8", 1), FakeRank("10.0.0.9", 2)]
    seen = []
    got = start_ranks(ranks, lambda refs, what: (seen.append(what), refs[0])[1])
    assert got == ("10.0.0.7", 29517)
    assert [r.got for r in ranks] == [("10.0.0.7", 29517)] * 3
    assert seen == ["rendezvous_address", "setup"]                 # the address first, then every rank's setup


def test_rank_zero_reports_its_nodes_ip_and_the_port_of_the_store_it_holds_open(monkeypatch):
    import socket

    import ray
    import torch.distributed as dist

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.7")
    spec = LearnerSpec.of(load_recipe(None, []), "model-dir")
    rank0 = LearnerActor(0, 2, spec)
    host, port = rank0.rendezvous_address()
    assert host == "10.0.0.7"
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", port))                                # taken from the moment it was chosen: by the store
    other = dist.TCPStore("127.0.0.1", port, 2, is_master=False)   # which the other ranks reach
    other.set("rank1", "here")
    assert rank0._rendezvous.get("rank1") == b"here"


def test_a_local_model_dir_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert ensure_local(ModelFiles(str(tmp_path), "n", "1.2.3.4")) == str(tmp_path)


def test_a_missing_model_dir_with_nothing_to_ship_it_names_the_node_and_the_path(monkeypatch, tmp_path):
    import ray

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.9")
    missing = str(tmp_path / "not-here")
    with pytest.raises(ModelFilesError, match=r"not-here is not on node 10\.0\.0\.9"):
        ensure_local(ModelFiles(missing, "origin", "10.0.0.1", holder=None))
    with pytest.raises(ModelFilesError, match="not-here"):
        ensure_local(missing)


class FakeRay:
    """``ray.get`` of fake refs (plain values)."""

    @staticmethod
    def get(value, timeout=None):
        return value


def test_holder_files_are_copied_into_a_cache_keyed_by_content_and_checked(tmp_path, monkeypatch):
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "model.safetensors").write_bytes(bytes(range(256)) * 1000)
    (src / "sub" / "tokenizer.json").write_text("tok")
    (src / ".cache").mkdir()
    (src / ".cache" / "junk").write_text("x")
    holder = ModelFileHolder(str(src))
    for name in ("manifest", "read"):
        setattr(holder, name, _Method(getattr(holder, name)))
    monkeypatch.setattr(model_files, "CHUNK_BYTES", 1000)            # several chunks per file
    import ray

    monkeypatch.setattr(ray, "get", FakeRay.get)
    manifest = holder.manifest.remote()
    out = model_files._materialize(holder, manifest, tmp_path / "cache", "node test")
    assert sorted(p.name for p in (tmp_path / "cache" / manifest["digest"]).iterdir()) == \
        [".inflight-complete", "config.json", "model.safetensors", "sub"]
    for rel in ("config.json", "model.safetensors", "sub/tokenizer.json"):
        assert (src / rel).read_bytes() == (tmp_path / "cache" / manifest["digest"] / rel).read_bytes()
    assert out == str(tmp_path / "cache" / manifest["digest"])
    # a corrupted chunk is caught by the file's SHA-256, and nothing is left in place
    holder.read = _Method(lambda rel, off, n: b"\0" * n)
    other = dict(manifest, digest=hashlib.sha256(b"other").hexdigest())
    with pytest.raises(ModelFilesError, match="expected"):
        model_files._materialize(holder, other, tmp_path / "cache", "node test")
    assert not (tmp_path / "cache" / other["digest"]).exists()


def test_the_holder_keeps_serving_files_removed_after_it_opened_them(tmp_path):
    import shutil

    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text('{"a": 1}')
    holder = ModelFileHolder(str(src))
    shutil.rmtree(src)
    assert holder.read("config.json", 0, 100) == b'{"a": 1}'
    assert [f[0] for f in holder.manifest()["files"]] == ["config.json"]
