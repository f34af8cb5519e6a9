"""The pool's engine table: an engine it does not know is not up; which engines serve, lag, and are ready; the
states a scale-up and a scale-down go through."""
from __future__ import annotations

from protocol.pool_replies import EngineStatus
from services.pool.engine_table import EngineState, EngineTable


def test_an_unknown_engine_is_not_up_and_an_empty_table_is_not_ready():
    table = EngineTable()
    assert table.up() == [] and table.serving(0) == [] and not table.all_serving()
    assert "e0" not in table and len(table) == 0


def test_states_follow_boot_death_restart_and_installs():
    table = EngineTable()
    table.mark_up("e0", 0, 11, "11.1")
    table.mark_up("e1", 0, 12, "12.1")
    assert table.all_serving() and table.serving(0) == ["e0", "e1"]
    table.mark_down("e1", "RayActorError: died")
    assert table["e1"] == EngineState(up=False, version=0, pid=12, incarnation="12.1", error="RayActorError: died")
    assert table.up() == ["e0"] and not table.all_serving()
    table.set_version("e0", 3)
    assert table.serving(3) == ["e0"] and table.behind(3) == []
    table.mark_up("e1", 0, 13, "13.1")                             # restarted: a new process, the model on disk
    assert table.behind(3) == ["e1"] and table["e1"].error is None
    assert table.incarnations_up() == {"e0": "11.1", "e1": "13.1"}
    assert table.snapshot(3)["e1"] == EngineStatus(up=True, version=0, pid=13, incarnation="13.1", error=None,
                                                   starting=False, draining=False, state="stale")
    assert table.snapshot(3)["e0"].state == "up"
    assert list(table) == ["e0", "e1"]


def test_a_scaled_engine_is_starting_then_stale_until_it_holds_the_version_and_a_draining_one_takes_no_work():
    table = EngineTable()
    table.mark_up("e0", 4, 11, "11.1")
    table.mark_starting("e1")                                      # a scale-up boots it
    assert table.state("e1", 4) == "starting" and table.up() == ["e0"]
    assert table.all_serving()                                     # readiness does not wait for it
    table.mark_up("e1", 0, 12, "12.1")                             # booted: the model on disk
    assert table.state("e1", 4) == "stale" and table.serving(4) == ["e0"] and table.behind(4) == ["e1"]
    table.set_version("e1", 4)
    assert table.state("e1", 4) == "up" and table.serving(4) == ["e0", "e1"]
    table.mark_draining("e1")                                      # a scale-down removes it
    assert table.state("e1", 4) == "draining" and table.serving(4) == ["e0"]
    assert table.up() == ["e0", "e1"]                              # still installs pushes while it finishes
    table.mark_up("e1", 5, 12, "12.1")
    assert table["e1"].draining                                    # a health answer does not undo the drain
    assert table.counts(4) == {"up": 1, "draining": 1}
    table.forget("e1")
    assert "e1" not in table and table.all_serving()
    table.mark_starting("e2")
    table.mark_down("e2", "did not boot")
    assert table.state("e2", 4) == "down" and not table.all_serving()
