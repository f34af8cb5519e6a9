"""Validation: the validation prompts answered by the pool at the current version, outside the training stream.

The :class:`Validator` sends its prompts to the pool's ``evaluate`` call in batches of ``grpo.val_batch_size``
and gets the scored groups back as the call's result: nothing goes through the job's trajectory channel,
prompt book, ledger or buffer, so validation is never trained on and does not touch the versions or the
scheduling of training groups (in async mode those keep generating meanwhile). Engines sample
``grpo.val_num_generations`` answers per prompt at ``grpo.val_temperature`` (0: greedy) and score them with
the training reward. :func:`validation_metrics` turns the rewards into the step row's ``val_*`` keys.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from protocol import PromptRequest, TrajectoryGroup, decode, encode
from protocol.pool_client import EVALUATE_GRACE_S, PoolClient
from services.job.failures import FailureLog

if TYPE_CHECKING:
    from services.recipe.config import Recipe

log = logging.getLogger("inflight.validation")
CORRECT = 1.0 - 1e-6
"""An answer is correct when its reward is at least this (the math rewards give 1.0 for a right answer)."""
VAL_PREFIX = "val:"
"""Validation prompt ids start with this; a training ledger never holds one."""


@dataclass(frozen=True)
class ValidationResult:
    """One validation's numbers; :meth:`metrics` gives them as the step row's keys."""

    reward_mean: float
    """Mean reward over every scored answer (NaN if none was scored)."""
    accuracy: float
    """Share of prompts whose first answer is correct (reward >= ``CORRECT``), over the prompts whose first
    answer was scored (a failed answer is counted in ``failed_samples``, never as wrong)."""
    pass_at_k: float | None
    """Share of prompts with at least one correct answer among their k, over the prompts with a scored answer;
    None when k = 1."""
    samples: int
    """Answers asked for: prompts x k."""
    failed_samples: int
    """Answers that failed (generation or reward) or never came back."""
    seconds: float
    """Wall time of the validation."""
    policy_version: int | None = None
    """Oldest version among the validation's answer tokens (the version validated)."""

    def metrics(self) -> dict[str, float | int]:
        """``val_reward_mean``, ``val_accuracy``, ``val_pass_at_k`` (k > 1 only), ``val_samples``,
        ``val_failed_samples``, ``val_seconds`` and ``val_policy_version`` (when known)."""
        out: dict[str, float | int] = {"val_reward_mean": self.reward_mean, "val_accuracy": self.accuracy,
                                       "val_samples": self.samples, "val_failed_samples": self.failed_samples,
                                       "val_seconds": self.seconds}
        if self.pass_at_k is not None:
            out["val_pass_at_k"] = self.pass_at_k
        if self.policy_version is not None:
            out["val_policy_version"] = self.policy_version
        return out


def validation_metrics(rewards: list[list[float | None]], k: int, seconds: float = 0.0,
                       policy_version: int | None = None) -> ValidationResult:
    """The numbers of one validation from each prompt's k rewards (None: a failed answer; a prompt whose group
    never came back is a list of k Nones)."""
    if k < 1:
        raise ValueError(f"grpo.val_num_generations: expected >= 1, got {k}")
    scored = [r for group in rewards for r in group if r is not None]
    firsts = [group[0] for group in rewards if group and group[0] is not None]
    with_answer = [[r for r in group if r is not None] for group in rewards]
    with_answer = [g for g in with_answer if g]
    nan = float("nan")
    return ValidationResult(
        reward_mean=sum(scored) / len(scored) if scored else nan,
        accuracy=sum(r >= CORRECT for r in firsts) / len(firsts) if firsts else nan,
        pass_at_k=(sum(any(r >= CORRECT for r in g) for g in with_answer) / len(with_answer) if with_answer else nan)
        if k > 1 else None,
        samples=len(rewards) * k, failed_samples=len(rewards) * k - len(scored), seconds=seconds,
        policy_version=policy_version)


class Validator:
    """Runs validations of a job's prompts on its pool (``pool.evaluate``)."""

    def __init__(self, recipe: Recipe, prompts: list[PromptRequest], pool: PoolClient | Any,
                 failures: FailureLog | None = None):
        """``failures`` records the reasons of failed answers (``RUN_DIR/failures.jsonl``; never in the training
        counts)."""
        g, gen = recipe.grpo, recipe.policy.generation
        self.failures = failures
        self.pool, self.pool_name, self.prompts = PoolClient.of(pool), recipe.rollout_pool.name, prompts
        self.batch_size, self.k, self.temperature = g.val_batch_size, g.val_num_generations, g.val_temperature
        self.period, self.at_start = g.val_period, g.val_at_start
        self.timeout_s = gen.group_deadline_s
        """Longest one batch may take on the pool (every answer may need all its retries)."""

    def due(self, step: int) -> bool:
        """Whether a validation runs at the end of ``step`` (every ``grpo.val_period`` steps)."""
        return self.period > 0 and step % self.period == 0

    def run(self, step: int) -> ValidationResult:
        """Validate the version the pool serves now; ``step`` labels the progress bar."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        by_id: dict[str, list[float | None]] = {}
        versions: list[int] = []
        with tqdm(total=len(self.prompts), desc=f"validation (step {step})", unit="prompt", leave=False,
                  dynamic_ncols=True) as bar:
            for start in range(0, len(self.prompts), self.batch_size):
                batch = self.prompts[start:start + self.batch_size]
                for group in self._evaluate(batch, step):
                    if self.failures is not None:
                        self.failures.group(group, step=step, count=False)
                    by_id[group.prompt_id] = [t.reward if t.finish_reason != "error" else None
                                              for t in group.trajectories]
                    versions.extend(int(t.sampled_versions.min()) for t in group.trajectories  # no env tokens
                                    if t.finish_reason != "error" and t.sampled_versions.size)
                bar.update(len(batch))
        rewards = [by_id.get(p.prompt_id, [None] * self.k) for p in self.prompts]
        result = validation_metrics(rewards, self.k, time.perf_counter() - t0, min(versions) if versions else None)
        missing = sum(p.prompt_id not in by_id for p in self.prompts)
        if missing:
            log.warning("validation at step %d: %d/%d prompts came back without a group from pool %r", step,
                        missing, len(self.prompts), self.pool_name)
        if math.isnan(result.reward_mean):
            log.warning("validation at step %d: no answer was scored (pool %r)", step, self.pool_name)
        return result

    def _evaluate(self, batch: list[PromptRequest], step: int) -> list[TrajectoryGroup]:
        try:
            reply = self.pool.evaluate([encode(p) for p in batch], self.k, self.temperature, self.timeout_s)
        except Exception as exc:  # re-raised with the pool's name and the bound
            raise RuntimeError(f"validation at step {step}: pool {self.pool_name!r} did not answer "
                               f"{len(batch)} prompts within {self.timeout_s + EVALUATE_GRACE_S:.0f} s: "
                               f"{type(exc).__name__}: {exc}"[:800]) from exc
        for i, failure in enumerate(reply.failed):
            if i < 3:
                log.warning("validation at step %d: prompt %s failed on pool %r: %s", step, failure.prompt_id,
                            self.pool_name, failure.reason)
            if self.failures is not None:
                self.failures.prompt(failure.prompt_id, step, failure.reason, failure.engine_id or "",
                                     samples=self.k, count=False)
        return [cast(TrajectoryGroup, decode(b, expect=TrajectoryGroup)) for b in reply.groups]
