"""Failed samples reach the run directory (issue 33, item 5): ``failures.jsonl`` names each failed group's step,
prompt, environment or reward, kind and reason, and the step row's ``failed_samples`` counts them by kind, also
for groups the job drops (a group whose every sample failed is never trained, so the learner never sees it)."""
from __future__ import annotations

import json

from job_fakes import FakeLearner, FakePool, ListChannel, make_job

from protocol import ControlMessage, Trajectory, TrajectoryGroup, encode
from services.job.failures import FailureLog
from services.job.run_log import StepTimer

REASON = "environment 'secret_env': reset raised KeyError: 'secret'"


def env_failed_group(pid: str, step: int = 1, failed: int = 2) -> TrajectoryGroup:
    """A group of 2 whose first ``failed`` samples failed in the environment's reset (the others scored)."""
    trajs = [Trajectory([], [], [], None, "error", REASON, failure_kind="environment") if i < failed
             else Trajectory([1, 2], [-0.5, -0.25], [0, 0], float(i), "stop") for i in range(2)]
    return TrajectoryGroup(f"g-{pid}", pid, [5], trajs, 2, 16, scheduled_step=step, engine_id="e0")


def good_group(pid: str, step: int = 1) -> TrajectoryGroup:
    return env_failed_group(pid, step, failed=0)


def test_a_dropped_group_of_environment_failures_is_in_failures_jsonl_and_counted_in_the_step_row(
        monkeypatch, tmp_path):
    answers = iter([env_failed_group, good_group])
    pool = FakePool(ListChannel(), answer=lambda req: next(answers)(req.prompt_id, req.scheduled_step))
    job = make_job(monkeypatch, tmp_path, pool=pool, learner=FakeLearner(version=1),
                   overrides=("checkpointing.enabled=false", "env.reward_fn=repeat_letter"))
    job.push_weights(reset=True)
    job.schedule(1)
    (taken,) = job.collect(1)                                  # the failed group was dropped and replaced
    assert job.book.ledger.dropped and taken.group.trajectories[0].ok
    row = job.finish_step(1, {"failed_samples": 0, "reward_mean": 0.5}, StepTimer())
    assert row["failed_samples"] == 2 and row["failed_samples_environment"] == 2
    assert row["failed_samples_generation"] == row["failed_samples_reward"] == row["failed_samples_length"] == 0
    assert row["failed_samples_trained"] == 0                  # the learner's count: none in the trained groups
    (line,) = [json.loads(x) for x in (tmp_path / "failures.jsonl").read_text().splitlines()]
    first = next(iter(job.book.ledger.dropped))
    assert line == {"step": 1, "prompt_id": first, "kind": "environment", "reason": REASON, "samples": 2,
                    "source": "repeat_letter", "group_id": f"g-{first}", "engine_id": "e0"}
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["failed_samples"] == 2
    row2 = job.finish_step(2, {}, StepTimer())                 # counted once: the next row starts at 0
    assert row2["failed_samples"] == 0


def test_one_line_per_kind_and_reason_and_a_prompt_that_failed_whole(tmp_path):
    log = FailureLog(tmp_path, "math", group_size=4)
    trajs = [Trajectory([], [], [], None, "error", "reward: timed out", failure_kind="reward"),
             Trajectory([], [], [], None, "error", "reward: timed out", failure_kind="reward"),
             Trajectory([], [], [], None, "error", "turn 1: timeout (after 2 attempts)", failure_kind="generation"),
             Trajectory([], [], [], None, "error", "from an older engine")]
    recs = log.group(TrajectoryGroup("g", "p", [5], trajs, 4, 16, scheduled_step=3))
    assert [(r.kind, r.reason, r.samples) for r in recs] == [
        ("generation", "turn 1: timeout (after 2 attempts)", 1), ("reward", "reward: timed out", 2),
        ("unknown", "from an older engine", 1)]
    log.prompt("q", 4, "generation failed: RuntimeError: boom", engine_id="e1")
    lines = [json.loads(x) for x in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and lines[-1]["samples"] == 4 and lines[-1]["kind"] == "generation"
    assert log.take_counts() == {"failed_samples": 8, "failed_samples_generation": 5, "failed_samples_environment": 0,
                                 "failed_samples_reward": 2, "failed_samples_length": 0, "failed_samples_unknown": 1}
    assert log.take_counts()["failed_samples"] == 0


def test_a_generation_error_report_is_recorded_with_its_reason(monkeypatch, tmp_path):
    job = make_job(monkeypatch, tmp_path, overrides=("checkpointing.enabled=false",))
    job.schedule(1)
    (pid,) = job.book.ledger.pending()
    job.book.receive(encode(ControlMessage("error", {"prompt_id": pid, "scheduled_step": 1, "engine_id": "e0",
                                                     "reason": "generation failed: EngineError: dead"}, 0.0)))
    (line,) = [json.loads(x) for x in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert (line["prompt_id"], line["kind"], line["samples"], line["reason"]) == (
        pid, "generation", 2, "generation failed: EngineError: dead")


def test_validations_failed_answers_are_on_record_but_not_in_the_training_counts(tmp_path):
    from handle_fakes import ServeMethod

    from protocol import PromptRequest, decode
    from protocol.pool_replies import EvaluationReply, FailedPrompt
    from services.recipe.config import load_recipe
    from services.job.validation import Validator

    def evaluate(prompt_bytes, k, temperature, timeout_s):
        ids = [decode(b, expect=PromptRequest).prompt_id for b in prompt_bytes]
        return EvaluationReply([encode(env_failed_group(ids[0], step=0, failed=1))],
                               [FailedPrompt(ids[1], "evaluate on engine e1 failed: boom", engine_id="e1")])

    class Pool:
        pass

    pool = Pool()
    pool.evaluate = ServeMethod(evaluate)  # type: ignore[attr-defined]
    log = FailureLog(tmp_path, "repeat_letter", group_size=8)
    recipe = load_recipe(None, ["grpo.val_num_generations=2", "grpo.val_temperature=1.0"])
    result = Validator(recipe, [PromptRequest(f"val:q{i}", [1, 2]) for i in range(2)], pool, log).run(5)
    assert result.failed_samples == 3                                # 1 in q0's group, q1's 2 answers
    lines = sorted((json.loads(x) for x in (tmp_path / "failures.jsonl").read_text().splitlines()),
                   key=lambda x: x["prompt_id"])
    assert [(x["step"], x["prompt_id"], x["kind"], x["samples"]) for x in lines] == [
        (5, "val:q0", "environment", 1), (5, "val:q1", "generation", 2)]
    assert lines[1]["reason"] == "evaluate on engine e1 failed: boom" and lines[1]["engine_id"] == "e1"
    assert log.take_counts()["failed_samples"] == 0                  # the row's val_failed_samples has them
