"""The learner's ranks started beside the pool in an embedded CPU run (``services.app``): in a thread of their own,
handed to the job when the pool is up, stopped when the pool does not start, their own error giving way to the
pool's. Built with a stand-in ``LearnerGroup``; the real one runs in tests/integration/services/test_cli_run.py."""
from __future__ import annotations

import threading

import pytest

from services import app
from services.recipe.config import Recipe


class Ranks:
    """A stand-in for ``LearnerGroup``: records the thread that built it and whether it was shut down."""

    built: list[Ranks] = []

    def __init__(self, recipe: Recipe, model_path: str):
        if model_path == "fails":
            raise RuntimeError("rank 0 did not start")
        self.thread = threading.current_thread().name
        self.stopped = False
        Ranks.built.append(self)

    def shutdown(self) -> None:
        self.stopped = True


@pytest.fixture
def ranks(monkeypatch):
    Ranks.built = []
    monkeypatch.setattr(app, "LearnerGroup", Ranks)
    monkeypatch.setattr(app, "resolve_policy_model", lambda policy: "model-dir")
    return Ranks


def test_the_ranks_start_in_a_thread_of_their_own_and_come_back_whole(ranks):
    early = app.start_learner_early(Recipe())
    group = early.result(timeout=10)
    assert isinstance(group, Ranks) and group.thread.startswith("learner-start")
    assert group.thread != threading.current_thread().name and not group.stopped


def test_ranks_started_for_a_pool_that_did_not_start_are_stopped(ranks):
    early = app.start_learner_early(Recipe())
    app.discard_learner(early)
    assert [r.stopped for r in ranks.built] == [True]


def test_ranks_that_failed_themselves_give_way_to_the_pools_error(ranks, monkeypatch):
    monkeypatch.setattr(app, "resolve_policy_model", lambda policy: "fails")
    early = app.start_learner_early(Recipe())
    app.discard_learner(early)  # no error of its own: the pool's is the one reported
    assert ranks.built == []
    with pytest.raises(RuntimeError, match="rank 0 did not start"):
        early.result()  # what run_learner raises when the pool did start
