"""bench/nemotron_h_noise.py's comparisons: how score lists are compared (max / mean |difference| and the requests
that differ at all, a bit-level difference counted), which tensors differ between two fingerprints, and that
'alone' puts one request in the engine at a time while 'together' submits them all at once. No engine."""
from __future__ import annotations

import numpy as np
import pytest
from repo_scripts import load_script


def _noise():
    return load_script("bench/nemotron_h_noise.py", "nemotron_h_noise_bench")  # imports nemotron_h_gpu


class _Recorder:
    """Stands in for a served engine: scores token t as -t / 10 and records the size of each submission."""

    def __init__(self):
        self.batches: list[int] = []

    def logprobs(self, prompts, answers):
        self.batches.append(len(prompts))
        return [-np.asarray(a, np.float64) / 10 for a in answers]


def test_gap_counts_every_request_that_differs_even_by_one_ulp():
    noise = _noise()
    x = [np.array([-1.0, -2.0]), np.array([-0.5]), np.array([-3.0, -3.0, -3.0])]
    y = [np.array([-1.0, -2.25]), np.array([np.nextafter(-0.5, 0.0)]), np.array([-3.0, -3.0, -3.0])]
    g = noise.gap(x, y)
    assert g["max"] == pytest.approx(0.25)
    assert g["mean"] == pytest.approx((0.25 + abs(np.nextafter(-0.5, 0.0) + 0.5)) / 6)
    assert g["requests_differing"] == 2
    assert noise.gap(x, x) == {"max": 0.0, "mean": 0.0, "requests_differing": 0}
    with pytest.raises(ValueError):  # a lost request is not a match
        noise.gap(x, y[:2])


def test_differing_names_changed_missing_and_extra_tensors():
    noise = _noise()
    f = {"a": ((2,), "bf16", 1), "b": ((2,), "bf16", 2), "c": ((1,), "f32", 3)}
    g = {"a": ((2,), "bf16", 1), "b": ((2,), "bf16", 5), "d": ((1,), "f32", 3)}
    assert noise.differing(f, g) == ["b", "c", "d"]
    assert noise.differing(f, dict(f)) == []


def test_alone_submits_one_request_at_a_time_and_together_all_at_once():
    noise = _noise()
    prompts, answers = [[1], [2, 3], [4]], [[5, 6], [7], [8, 9, 10]]
    engine = _Recorder()
    alone = noise.alone(engine, prompts, answers)
    assert engine.batches == [1, 1, 1]
    together = noise.together(engine, prompts, answers)
    assert engine.batches == [1, 1, 1, 3]
    assert noise.gap(alone, together)["max"] == 0.0
    assert [a.tolist() for a in alone] == [[-0.5, -0.6], [-0.7], [-0.8, -0.9, -1.0]]
