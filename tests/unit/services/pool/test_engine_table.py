"""The pool's engine table: an engine it does not know is not up; which engines serve, lag, and are ready."""
from __future__ import annotations

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
    assert table.as_dict()["e1"] == {"up": True, "version": 0, "pid": 13, "incarnation": "13.1", "error": None}
    assert list(table) == ["e0", "e1"]
