"""Learner checkpoints are read without running code (learner/checkpoint.py, issue 32.4): a rank file holding a
pickled ``__reduce__`` payload is refused in one line naming it and the payload never runs; what a real save
holds (tensors, optimizer state, numpy/python RNG states, the job's bytes and lists) still round-trips; a
checkpoint of another model is one line naming the first tensor that differs (issue 32.6)."""
from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from learner import checkpoint

LAYOUT = {"world_size": 1, "tp": 1, "ep": 1}


class Payload:
    """Runs its code when unpickled: ``exec`` touches the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


@pytest.fixture
def one_rank(monkeypatch):
    """The running layout of one rank, without a process group."""
    monkeypatch.setattr(checkpoint, "layout", lambda: dict(LAYOUT))
    monkeypatch.setattr(checkpoint.dist, "get_rank", lambda: 0)


def write_checkpoint(path: Path, payload: object) -> Path:
    path.mkdir()
    (path / checkpoint.META_FILE).write_text(json.dumps({"step": 3, "policy_version": 3, **LAYOUT}))
    torch.save(payload, checkpoint.rank_file(path, 0))
    return path


@pytest.mark.parametrize("where", ["top", "nested"])
def test_a_pickled_reduce_payload_is_refused_and_never_runs(tmp_path, one_rank, where):
    marker = tmp_path / "ran"
    evil = Payload(marker)
    ckpt = write_checkpoint(tmp_path / "ckpt", evil if where == "top" else {"model": {}, "extra": {"x": [evil]}})
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(ckpt)
    assert not marker.exists()  # old code (weights_only=False): exec ran and made it
    line = str(err.value)
    assert "\n" not in line and str(checkpoint.rank_file(ckpt, 0)) in line, line
    assert "refused, it holds a pickled reference to exec" in line, line


def test_a_truncated_rank_file_is_one_line_naming_it(tmp_path, one_rank):
    ckpt = write_checkpoint(tmp_path / "ckpt", {"model": {"w": torch.ones(3)}})
    f = checkpoint.rank_file(ckpt, 0)
    f.write_bytes(f.read_bytes()[:40])
    with pytest.raises(checkpoint.CheckpointError, match="unreadable") as err:
        checkpoint.load(ckpt)
    assert "\n" not in str(err.value) and str(f) in str(err.value)


def test_what_a_save_holds_round_trips(tmp_path, one_rank):
    random.seed(3)
    np.random.seed(3)
    payload = {"model": OrderedDict(w=torch.randn(4, 2), b=torch.zeros(2, dtype=torch.bfloat16)),
               "optimizer": {"optimizers": [{"torch_state": {"state": {0: {"step": torch.tensor(2.0),
                                                                            "exp_avg": torch.ones(2)}},
                                                             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99),
                                                                               "params": [0], "foreach": None}]},
                                             "params": [torch.ones(2)]}],
                             "scheduler": {"num_steps": 2, "max_lr": 1e-3}},
               "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                       "tracker": {"model-parallel-rng": torch.get_rng_state()}},
               "step": 3, "policy_version": 3,
               "extra": {"step": 3, "data_position": {"epoch": 0, "index": 7}, "buffer": [b"\x00\x01"],
                         "open_requests": [b"\x93"], "parity_set": [([1, 2], [3])], "drops": {"stale": 1}}}
    loaded, meta = checkpoint.load(write_checkpoint(tmp_path / "ckpt", payload))
    assert meta["step"] == 3 and loaded["extra"] == payload["extra"] and loaded["step"] == 3
    assert loaded["rng"]["python"] == payload["rng"]["python"]
    name, keys, *rest = loaded["rng"]["numpy"]
    assert name == "MT19937" and np.array_equal(keys, payload["rng"]["numpy"][1]) and rest == [*payload["rng"]
                                                                                               ["numpy"][2:]]
    assert all(torch.equal(loaded["model"][k], v) for k, v in payload["model"].items())
    assert loaded["optimizer"]["optimizers"][0]["torch_state"]["param_groups"][0]["betas"] == (0.9, 0.99)


def test_a_checkpoint_of_another_model_is_one_line_naming_the_first_difference(tmp_path, one_rank):
    ckpt = write_checkpoint(tmp_path / "ckpt", {"model": {"a.weight": torch.zeros(4, 8), "b.weight": torch.zeros(2)}})
    running = {"a.weight": torch.zeros(8, 8), "c.weight": torch.zeros(2)}
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(ckpt, running)
    line = str(err.value)
    assert "\n" not in line and str(ckpt) in line and "another model" in line
    assert "a.weight is [4, 8] in the checkpoint, [8, 8] in this model" in line
    assert "1 missing (first: c.weight)" in line and "1 unexpected (first: b.weight)" in line
    checkpoint.load(ckpt, {"a.weight": torch.ones(4, 8), "b.weight": torch.ones(2)})  # same names and shapes


def test_another_layout_is_a_checkpoint_error(tmp_path, one_rank, monkeypatch):
    ckpt = write_checkpoint(tmp_path / "ckpt", {"model": {}})
    monkeypatch.setattr(checkpoint, "layout", lambda: {**LAYOUT, "tp": 2})
    with pytest.raises(checkpoint.CheckpointError, match="layout"):
        checkpoint.load(ckpt)
