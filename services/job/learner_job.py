"""A learner job attached to a rollout pool: one verb for each line of the loops.

:mod:`services.job.loop_async` and :mod:`services.job.loop_sync` call ``start``, ``steps``, ``schedule``,
``collect``, ``train``, ``push_weights`` and ``finish_step`` (and, colocated, ``sleep_engines`` /
``wake_engines``). The job holds the parts behind them: the prompt book (:mod:`services.job.prompt_book`),
the parity probe (:mod:`services.job.parity`), the weight transport (:mod:`services.refit`), skipped steps
(:mod:`services.job.skips`), the validator (:mod:`services.job.validation`), the run log and checkpoints.
It reaches the pool only through its DeploymentHandle, wrapped in typed calls (``protocol.pool_client``); what
each verb does is in ``docs/architecture.md`` ("The learner job").
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from protocol import PromptRequest, encode
from protocol.pool_client import PoolClient
from services.data.learner_images import LearnerImages
from services.data.prompt_source import PromptSource, validation_prompts
from services.job.batch_stats import batch_stats
from services.job.buffer import BufferedGroup
from services.job.channel import ChannelTimeout, TrajectoryChannel
from services.job.checkpoints import Checkpoints, JobState
from services.job.failures import FailureLog
from services.job.parity import ParityProbe, fixed_sequences
from services.job.prompt_book import PromptBook
from services.job.run_log import RunLog, StepTimer
from services.job.skips import SkippedSteps
from services.job.validation import Validator
from services.refit import RefitResult, make_refit

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from services.job.learner_group import LearnerGroup
    from services.recipe.config import Recipe

log = logging.getLogger("inflight.job")
REFIT_ATTEMPTS = 3
UNDELIVERED_POLL_S = 5.0
"""How often ``collect`` asks the pool for prompts its engines could not deliver to this job's channel."""


class StepTimeout(TimeoutError):
    """The pool did not deliver a step's groups in time."""


class LearnerJob:
    def __init__(self, recipe: Recipe, model_path: str, pool: PoolClient | DeploymentHandle, learner: LearnerGroup,
                 run_dir: str | Path, resume: bool = True):
        """Attach to ``pool`` with a new channel; with ``resume``, continue from the run directory's latest
        checkpoint if there is one."""
        self.recipe, self.learner = recipe, learner
        self.pool = PoolClient.of(pool)  # protocol.pool_client: the pool's calls, typed
        self.id = f"learner-{uuid.uuid4().hex[:8]}"
        g, gen = recipe.grpo, recipe.policy.generation
        self.last_step, self.group_size = g.max_num_steps, g.num_generations_per_prompt
        self.collect_timeout_s = gen.group_deadline_s
        self.book = PromptBook(PromptSource.of_task(recipe, model_path), self._submit, g.num_prompts_per_step,
                               g.max_num_steps, g.async_grpo.max_trajectory_age_steps if g.async_grpo.enabled else 0,
                               max_prompts_per_step=g.dynamic_sampling_max_gen_batches * g.num_prompts_per_step
                               if g.use_dynamic_sampling else None, reward_scaling=g.reward_scaling,
                               failures=FailureLog(run_dir, recipe.data.env_name or recipe.env.reward_fn,
                                                   g.num_generations_per_prompt))
        self.images = LearnerImages.of(recipe.data, model_path)  # services.data.learner_images (text data: none)
        self.parity = ParityProbe(recipe.logger, self.pool, learner)  # services.job.parity: the rule of invariant 1
        self.step = 0
        self.version = learner.version()
        self.refit = make_refit(recipe, self.pool.handle, learner)
        self.last_refit: RefitResult | None = None
        self.pushed_version = -1  # the version last pushed to the engines
        self.skips = SkippedSteps(g.max_consecutive_skipped_steps)
        self.channel = TrajectoryChannel.create(f"{self.id}-trajectories", recipe.rollout_pool.max_inflight_groups)
        self.log = RunLog(run_dir, recipe.logger.tensorboard_enabled, recipe.logger, recipe.model_dump(mode="json"))
        self.checkpoints = Checkpoints(recipe.checkpointing, Path(run_dir))
        self.saved_step = 0  # the step of the last checkpoint this job wrote
        self.validator = Validator(recipe, validation_prompts(recipe, model_path), self.pool, self.book.failures) \
            if g.val_period or g.val_at_start else None  # services.job.validation: outside the training stream
        if resume:
            self._resume()  # a resumed run probes with its saved sequences; a fresh one builds them now
        if not self.parity.sequences or self.images.in_use:  # images are not in checkpoints: rebuilt
            self._parity_set(recipe.logger.parity_probe_sequences, recipe.policy.max_total_sequence_length)
        self.pool.attach(self.id, self.channel)

    # ------------------------------------------------------------ the loop's verbs
    def start(self, prefetch: int) -> None:
        """Install the learner's weights on the pool, probe every engine, and (re)submit outstanding prompts;
        with none outstanding (a fresh run), schedule the next ``prefetch`` steps."""
        self.push_weights(reset=True)
        self.checked_parity()
        if self.validator is not None and self.validator.at_start and self.step == 0:
            self.validate_at_start()
        if not self.book.resubmit_outstanding():
            for step in range(self.step + 1, self.step + 1 + prefetch):
                self.schedule(step)

    def steps(self, ahead: int) -> Iterator[int]:
        """The steps left to run, with a progress bar; before yielding step k it schedules the prompts of step
        k + ``ahead`` (0: sync, A: async). Ends at ``grpo.max_num_steps``, or earlier at the last step the data's
        ``grpo.max_num_epochs`` can fill (:meth:`PromptBook.schedule`)."""
        from tqdm import tqdm

        bar = tqdm(total=self.last_step, desc="GRPO", unit="step", initial=self.step, dynamic_ncols=True)
        step = self.step + 1
        while True:
            self.schedule(step + ahead)
            if step > min(self.last_step, self.book.last_step):
                break
            yield step
            bar.update(1)
            row = self.log.rows[-1] if self.log.rows else {}
            bar.set_postfix(reward=f"{row.get('reward_mean', float('nan')):.3f}",
                            age=f"{row.get('trajectory_age_mean', float('nan')):.2f}", v=self.version)
            step += 1
        bar.close()
        if self.step < self.last_step and self.checkpoints.cfg.enabled and self.saved_step != self.step:
            self.save_checkpoint(self.log.rows[-1] if self.log.rows else None)  # the data ended the run early

    def schedule(self, step: int) -> None:
        """Draw the prompts of ``step`` and submit them to the pool."""
        self.book.schedule(step)

    def collect(self, step: int) -> list[BufferedGroup]:
        """Read the channel until ``num_prompts_per_step`` good groups for ``step`` are buffered (the book drops,
        counts and replaces the others), within ``collect_timeout_s``; raises :class:`StepTimeout`."""
        deadline = time.monotonic() + self.collect_timeout_s
        next_poll = time.monotonic()  # at once, then every UNDELIVERED_POLL_S
        ready = self.book.ready(step)
        while True:
            if time.monotonic() >= next_poll:
                self.drop_undelivered()
                next_poll = time.monotonic() + UNDELIVERED_POLL_S
            now_ready = self.book.screen(step, self.version)
            if now_ready > ready:
                self.book.progressed()
            ready = now_ready
            self.book.submit_due()
            if ready >= self.book.per_step:
                return self.book.take(step)
            left = deadline - time.monotonic()
            if left <= 0:
                raise StepTimeout(f"pool {self.recipe.rollout_pool.name!r}: only {ready}/{self.book.per_step} groups "
                                  f"for step {step} after {self.collect_timeout_s:.0f} s ({self.book.losses()})")
            due = self.book.next_due_in()
            wait = min(left, 5.0) if due is None else min(left, 5.0, due)
            try:
                self.book.receive(self.channel.recv(max(0.01, wait)))
            except ChannelTimeout:
                if self.refit.engines_waiting():  # a restarted engine waits for our weights
                    self.push_weights(reset=True)

    def drop_undelivered(self) -> int:
        """Drop and replace the open prompts whose groups the pool's engines could not put into this job's
        channel; returns how many were dropped."""
        return self.book.drop_undelivered(self.pool.take_undelivered(self.id))

    def train(self, buffered: list[BufferedGroup]) -> dict:
        """One optimizer step on the learner ranks; a step the learner skips drops its prompts
        (:mod:`services.job.skips`). Returns the learner's metrics with the groups' ages."""
        import ray

        # A fixed order (not arrival order): a seeded sync run then trains on the same batches, packed the same
        # way, whether or not it was killed and resumed in between.
        buffered = sorted(buffered, key=lambda b: (b.group.scheduled_step, b.group.prompt_id))
        ages = [self.version - b.group.oldest_version for b in buffered]  # version at the start of the step
        metrics = self.learner.train_step([ray.put(b.data) for b in buffered], self.images.step_inputs(
            [(b.group, self.book.open_requests[b.group.prompt_id]) for b in buffered]))
        self.version = self.learner.version()
        self.book.settle(buffered, trained=not self.skips.record(metrics))
        metrics["trajectory_ages"] = ages
        metrics["trajectory_age_mean"] = float(np.mean(ages))
        metrics["trajectory_age_max"] = float(np.max(ages))
        metrics.update(batch_stats([b.group for b in buffered]).metrics())  # services.job.batch_stats
        sampling = self.book.sampling_stats(buffered[0].group.scheduled_step, buffered)
        metrics.update(sampling.metrics() if sampling else {})
        return metrics

    def sleep_engines(self) -> None:
        """Free the engines' GPU memory for training (colocated sync runs)."""
        self.pool.sleep_engines()

    def wake_engines(self) -> None:
        """Give the engines their GPU memory back, before the push."""
        self.pool.wake_engines()

    def push_weights(self, reset: bool = False) -> RefitResult | None:
        """Push the learner's version; without ``reset``, nothing (None) if it was pushed already (skipped step)."""
        if not reset and self.version == self.pushed_version:
            self.last_refit = None
            return self.last_refit
        last = None
        for attempt in range(1, REFIT_ATTEMPTS + 1):
            try:
                self.last_refit = self.refit.push(reset)
                self.pushed_version = self.version
                return self.last_refit
            except Exception as exc:  # noqa: BLE001 - retried, then reported with the cause
                last = exc
                log.warning("refit attempt %d/%d failed: %s", attempt, REFIT_ATTEMPTS, exc)
        raise RuntimeError(f"learner {self.id}: weight push v{self.version} failed {REFIT_ATTEMPTS} times; "
                           f"last error: {last}")

    def finish_step(self, step: int, metrics: dict, timer: StepTimer) -> dict:
        """Probe parity, write the step's row (run log, the pool's Prometheus report), stop after too many
        skipped steps in a row, save a checkpoint when one is due; returns the row."""
        self.step = step
        with timer.phase("parity_probe"):
            parity = self.checked_parity()  # after a skipped step too: same weights, still a valid check
        validation: dict = {}
        if self.validator is not None and self.validator.due(step):  # before the checkpoint: it ranks by it
            with timer.phase("validation"):
                validation = self.validator.run(step).metrics()
        times = timer.summary()
        times["other_s"] += times.pop("parity_probe_s", 0.0)
        times.pop("validation_s", None)  # the row has it as val_seconds
        row = {"step": step, "policy_version": self.version, **times}
        for k, v in metrics.items():
            if k == "gen_kl_error":
                row["train_gen_kl_error"] = v  # pi_gen vs pi_prev over the batch (includes lag-1 drift)
            elif k == "failed_samples":  # of the trained groups; the row's failed_samples counts all (below)
                row["failed_samples_trained"] = v
            elif isinstance(v, (int, float)):
                row[k] = v
        row.update(parity)
        row.update(validation)
        refit = self.last_refit
        row["refit_bytes"] = refit.bytes if refit else 0
        if refit:
            row.update(refit.row())
        row["tokens_per_s"] = metrics.get("tokens_per_s", float("nan"))
        row["buffer_groups"] = len(self.book.buffer)
        row.update(self.book.source.counts())  # data_epoch, data_dropped_too_long, data_skipped_invalid
        row.update({f"dropped_{k}": v for k, v in self.book.buffer.drops.items()})
        row.update(self.book.failures.take_counts())  # failed_samples[_<kind>]; reasons in failures.jsonl
        if metrics.get("step_skipped"):
            row["skip_reason"] = self.skips.last_reason
        self.log.write(row)
        report = {**row, "trajectory_ages": metrics.get("trajectory_ages", []), "rejected": self.book.take_rejected()}
        self.pool.report_step(report)
        self.skips.check(step)  # too many skipped steps in a row stop the job, once their rows are written
        if self.checkpoints.due(step, min(self.last_step, self.book.last_step)):
            self.save_checkpoint(row)
        return row

    def validate_at_start(self) -> dict:
        """``grpo.val_at_start``: validate the starting weights and write the step-0 row (``step`` 0, the
        version and the ``val_*`` keys only) to every sink; returns the row."""
        row = {"step": 0, "policy_version": self.version, **self.validator.run(0).metrics()} \
            if self.validator is not None else {}
        if row:
            self.log.write(row)
            self.pool.report_step(row)
        return row

    def checked_parity(self) -> dict:
        """Probe the engines (re)installed since their last probe (:mod:`services.job.parity`); on a failure push
        the weights once more and probe again, then stop with ``ParityError``."""
        return self.parity.checked(self.version, lambda: self.push_weights(reset=True))

    def save_checkpoint(self, row: dict | None = None) -> Path:
        """Save the learner and the job's state; ``row`` (the step's row) gives the value that ranks it."""
        self.saved_step = self.step
        return self.checkpoints.save(self.learner, JobState(self.step, self.book.state(), self.parity.sequences),
                                     row)

    def close(self) -> None:
        try:
            self.pool.detach(self.id)
        except Exception:  # noqa: BLE001 - the pool may be gone already
            pass
        self.channel.close()
        self.log.close()
        self.book.source.close()

    def _parity_set(self, n: int, max_len: int) -> None:
        """The probe's fixed sequences from the first prompts in row order, with their images (if any)."""
        first = self.book.source.first_prompts(n + 1)
        self.parity.sequences = fixed_sequences([p.prompt_ids for p in first], n, max_len,
                                                leave_out=self.images.vision_tokens)
        self.parity.images, self.parity.image_inputs = self.images.probe_images(first, n)

    # ------------------------------------------------------------ internals
    def _resume(self) -> None:
        found = self.checkpoints.load_latest(self.learner)
        if found is None:
            return
        path, state = found
        self.step = state.step
        self.version = self.learner.version()
        self.book.restore(state.book)
        self.parity.sequences = state.parity_set
        self.log.truncate_after(self.step)  # keep the record consistent with the checkpoint
        log.info("resumed from %s at step %d, version %d", path, self.step, self.version)

    def _submit(self, requests: list[PromptRequest]) -> None:
        self.pool.submit([encode(r) for r in requests], self.group_size)
