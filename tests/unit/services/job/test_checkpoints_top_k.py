"""Best-checkpoint keeping (services/job/checkpoints.py): the best keep_top_k by checkpointing.metric_name (higher
or lower is better), the newest always kept, a step without the metric ranking last, and the ranking read back
from disk after a restart."""
from __future__ import annotations

import json
from types import SimpleNamespace

from test_checkpoints import SavingLearner, state

from services.job.checkpoints import METRIC_FILE, Checkpoints, Ranked, kept


def cfg(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"enabled": True, "checkpoint_dir": "ckpt", "save_period": 1, "keep_top_k": 2,
                              "metric_name": "val_reward_mean", "higher_is_better": True, "save_hf": False, **kw})


def steps_on_disk(ck: Checkpoints) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in ck.root.glob("step_*"))


VALUES = {1: 0.2, 2: 0.9, 3: 0.5, 4: 0.7, 5: 0.1}


def test_the_best_k_by_the_metric_are_kept_with_the_newest():
    on_disk = [Ranked(s, v) for s, v in VALUES.items()]
    assert kept(on_disk, 2, "val_reward_mean", higher_is_better=True) == {2, 4, 5}   # 0.9, 0.7 + newest 5
    assert kept(on_disk, 2, "val_loss", higher_is_better=False) == {1, 5}            # 0.1 (also newest), 0.2
    assert kept(on_disk, 3, "val_reward_mean", higher_is_better=True) == {2, 4, 3, 5}
    assert kept(on_disk, 2, None, higher_is_better=True) == {4, 5}                   # no metric: the newest k
    assert kept([], 2, "m", True) == set()


def test_a_step_without_the_metric_ranks_last_and_ties_go_to_the_newer():
    on_disk = [Ranked(1, None), Ranked(2, 0.3), Ranked(3, float("nan")), Ranked(4, 0.3), Ranked(5, None)]
    assert kept(on_disk, 1, "m", higher_is_better=True) == {4, 5}
    assert kept(on_disk, 1, "m", higher_is_better=False) == {4, 5}
    assert kept(on_disk, 3, "m", higher_is_better=True) == {2, 4, 5}    # valued ones first, then the newest None
    assert kept([Ranked(1, None), Ranked(2, None), Ranked(3, 0.0)], 2, "m", True) == {3, 2}


def test_saving_stores_the_value_prunes_by_it_and_the_ranking_survives_a_restart(tmp_path):
    learner, ck = SavingLearner(), Checkpoints(cfg(), tmp_path)
    for step in (1, 2, 3):
        ck.save(learner, state(step), {"step": step, "val_reward_mean": VALUES[step]})
    assert steps_on_disk(ck) == [2, 3]  # 0.9 and 0.5 (newest); 0.2 went
    stored = json.loads((ck.root / "step_000002" / METRIC_FILE).read_text())
    assert stored == {"step": 2, "metric_name": "val_reward_mean", "value": 0.9}
    restarted = Checkpoints(cfg(), tmp_path)  # a new job: only the files on disk rank
    restarted.save(learner, state(4), {"step": 4})  # no validation at step 4: ranks last, kept as the newest
    assert steps_on_disk(restarted) == [2, 3, 4]
    restarted.save(learner, state(5), {"step": 5, "val_reward_mean": 0.1})
    assert steps_on_disk(restarted) == [2, 3, 5] and (restarted.root / "latest").read_text() == "step_000005"
    lower = Checkpoints(cfg(higher_is_better=False), tmp_path)
    lower.save(learner, state(6), {"step": 6, "val_reward_mean": 0.4})
    assert steps_on_disk(lower) == [5, 6]  # 0.1 and 0.4 (the newest) are the lowest


def test_without_a_metric_name_the_newest_k_are_kept(tmp_path):
    learner, ck = SavingLearner(), Checkpoints(cfg(metric_name=None, keep_top_k=2), tmp_path)
    for step in (1, 2, 3):
        ck.save(learner, state(step), {"step": step, "val_reward_mean": 10.0 - step})
    assert steps_on_disk(ck) == [2, 3]
