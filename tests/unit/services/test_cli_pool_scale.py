"""`inflight pool scale`: asks the pool's handle, prints what changed; a refused request or a bad value exits 2
with one line, engines that did not boot exit 1 (a fake pool handle; no Ray)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from handle_fakes import ServeMethod

from services import cli
from services.pool.fleet import ScaleError, ScaleRequestError, ScaleResult


@pytest.fixture
def pool(monkeypatch):
    """The handle ``pool scale`` connects to; ``answer`` is what its ``scale`` gives (a value or an error)."""
    import services.cluster.head
    import services.pool
    import services.cluster.ray_runtime

    calls: list[tuple] = []
    state = SimpleNamespace(answer=None, calls=calls)

    def scale(engines, drain_timeout_s):
        calls.append((engines, drain_timeout_s))
        if isinstance(state.answer, BaseException):
            raise state.answer
        return state.answer

    monkeypatch.setattr(services.cluster.head, "known_address", lambda: "127.0.0.1:6379")
    monkeypatch.setattr(services.cluster.ray_runtime, "connect", lambda address=None: address)
    monkeypatch.setattr(services.pool, "connect", lambda name: SimpleNamespace(name=name, scale=ServeMethod(scale)))
    return state


def test_scale_prints_the_engines_added_and_their_states(pool, capsys):
    pool.answer = ScaleResult(1, 2, ["p-engine-1"], [], 0, 31.5, {"p-engine-0": "up", "p-engine-1": "up"})
    assert cli.main(["pool", "scale", "--name", "p", "--engines", "2"]) == 0
    assert pool.calls == [(2, None)]
    assert capsys.readouterr().out == ("pool 'p': 1 -> 2 engines in 31.5 s, added p-engine-1; engines: "
                                       "p-engine-0 up, p-engine-1 up\n")


def test_scale_down_with_a_drain_bound_as_json(pool, capsys):
    pool.answer = ScaleResult(2, 1, [], ["p-engine-1"], 3, 0.4, {"p-engine-0": "up"})
    assert cli.main(["pool", "scale", "--name", "p", "--engines", "1", "--drain-timeout-s", "5", "--json"]) == 0
    assert pool.calls == [(1, 5.0)]
    assert json.loads(capsys.readouterr().out)["handed_back_prompts"] == 3


@pytest.mark.parametrize(("error", "code"), [
    (ScaleRequestError("pool 'p' cannot have 0 engines: rollout_pool.num_engines: Input should be greater than "
                       "or equal to 1"), 2),
    (ScaleError("pool 'p' is colocated on GPUs (...)", "refused"), 2),
    (ScaleError("pool 'p': adding engines failed: PoolStartError: engine p-engine-1 did not start", "failed"), 1),
])
def test_a_refused_or_failed_scale_is_one_line_with_its_exit_code(pool, capsys, error, code):
    pool.answer = error
    assert cli.main(["pool", "scale", "--name", "p", "--engines", "0"]) == code
    err = capsys.readouterr().err
    assert err == f"inflight: {error}\n"


def test_a_scale_error_keeps_its_outcome_through_pickling():
    import pickle

    again = pickle.loads(pickle.dumps(ScaleError("no room", "refused")))
    assert isinstance(again, ScaleError) and again.outcome == "refused" and str(again) == "no room"
