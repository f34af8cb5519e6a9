"""A learner job attached to a rollout pool: everything the loops need.

The loops in :mod:`services.loop_async` and :mod:`services.loop_sync` read
like the algorithm; this class holds the machinery behind each line:

- ``schedule(step)``  take prompts from the :class:`PromptSource`, record them
  in the :class:`PromptLedger`, submit them to the pool;
- ``collect(step)``   read the trajectory channel until ``num_prompts_per_step``
  good groups for ``step`` are buffered (stale / failed ones are dropped,
  counted, and replaced by fresh prompts; a second group for a prompt that
  is buffered or finished — the pool re-queues a dead engine's prompts — is
  counted as ``duplicate`` and ignored; prompts the pool reports as
  undelivered — an engine found the channel full for
  ``rollout_pool.channel_send_timeout_s`` — are dropped as ``undelivered`` and
  replaced; replacements of failed prompts back off, :mod:`services.backoff`),
  bounded by a deadline;
- ``train(groups)``   one optimizer step on the learner ranks (a step the learner
  skips drops its prompts as ``step_skipped``, :mod:`services.skips`);
- ``push_weights()``  move the learner's weights to every engine (in flight: the
  engines keep generating) by the recipe's transport (:mod:`services.refit`),
  retried up to ``REFIT_ATTEMPTS`` times; nothing when the version did not advance;
- ``finish_step()``   parity probe (:mod:`services.parity`; ``start`` probes too),
  metrics.jsonl / TensorBoard / Prometheus, checkpoint.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from pathlib import Path

import numpy as np

from protocol import ControlMessage, PromptRequest, ProtocolError, TrajectoryGroup, decode, encode
from services.backoff import ReplacementBackoff
from services.buffer import TrajectoryBuffer
from services.channel import ChannelTimeout, TrajectoryChannel
from services.data import PromptSource
from services.ledger import PromptLedger
from services.parity import ParityProbe, fixed_sequences
from services.refit import make_refit
from services.run_log import RunLog, StepTimer
from services.skips import DROP_REASON, SkippedSteps

log = logging.getLogger("inflight.job")
REFIT_ATTEMPTS = 3
UNDELIVERED_POLL_S = 5.0
"""How often ``collect`` asks the pool for prompts its engines could not deliver to this job's channel."""


class StepTimeout(TimeoutError):
    """The pool did not deliver a step's groups in time."""


class LearnerJob:
    def __init__(self, recipe, model_path: str, pool, learner, run_dir: str | Path, resume: bool = True):
        from transformers import AutoTokenizer

        from rollout.tasks import make_prompts

        self.recipe, self.pool, self.learner = recipe, pool, learner
        self.run_dir = Path(run_dir)
        self.id = f"learner-{uuid.uuid4().hex[:8]}"
        g = recipe.grpo
        self.n_per_step, self.group_size = g.num_prompts_per_step, g.num_generations_per_prompt
        self.last_step = g.max_num_steps
        gen = recipe.policy.generation
        self.collect_timeout_s = gen.request_timeout_s * (gen.max_retries + 1) + 60.0
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.source = PromptSource(make_prompts(recipe.env.task, tokenizer, recipe.env.num_prompts, g.seed), g.seed)
        self.ledger = PromptLedger()
        self.open_requests: dict[str, PromptRequest] = {}
        self.buffer = TrajectoryBuffer(max_age=g.async_grpo.max_trajectory_age_steps if g.async_grpo.enabled else 0)
        self.rejected: dict[str, int] = {}
        self.backoff = ReplacementBackoff()
        self.last_sample_error = ""  # why a sample of the last group dropped for too few valid samples failed
        self.parity = ParityProbe(recipe.logger, pool, learner)  # services.parity: the rule of invariant 1
        self.step = 0
        self.version = int(learner.call("version"))
        self.refit = make_refit(recipe, pool, learner)
        self.last_refit: dict = {}
        self.pushed_version = -1  # the version last pushed to the engines
        self.skips = SkippedSteps(g.max_consecutive_skipped_steps)
        self.channel = TrajectoryChannel.create(f"{self.id}-trajectories", recipe.rollout_pool.max_inflight_groups)
        if resume:
            self._resume()  # a resumed run probes with its saved sequences; a fresh one builds them now
        if not self.parity.sequences:
            self.parity.sequences = fixed_sequences([p.prompt_ids for p in self.source.prompts],
                                                    recipe.logger.parity_probe_sequences,
                                                    recipe.policy.max_total_sequence_length)
        self.log = RunLog(self.run_dir, recipe.logger.tensorboard_enabled)
        pool.attach.remote(self.id, self.channel).result(timeout_s=60)

    # ------------------------------------------------------------ the loop's verbs
    def start(self, prefetch: int) -> None:
        """Install the learner's weights on the pool, probe every engine, and (re)submit outstanding prompts;
        with none outstanding (a fresh run), schedule the next ``prefetch`` steps."""
        self.push_weights(reset=True)
        self.checked_parity()
        pending = [self.open_requests[p] for p in self.ledger.pending() if p not in self._buffered_ids()]
        if pending:
            self._submit(pending)
        for step in range(self.step + 1, self.step + 1 + prefetch) if not pending else ():
            self.schedule(step)

    def steps(self):
        from tqdm import tqdm

        bar = tqdm(range(self.step + 1, self.last_step + 1), desc="GRPO", unit="step", initial=self.step,
                   total=self.last_step, dynamic_ncols=True)
        for step in bar:
            yield step
            row = self.log.rows[-1] if self.log.rows else {}
            bar.set_postfix(reward=f"{row.get('reward_mean', float('nan')):.3f}",
                            age=f"{row.get('trajectory_age_mean', float('nan')):.2f}", v=self.version)

    def schedule(self, step: int, n: int | None = None, delay_s: float = 0.0) -> None:
        """Draw ``n`` prompts for ``step`` and submit them to the pool, after ``delay_s`` (see services.backoff)."""
        if step > self.last_step:
            return
        requests = self.source.next(n or self.n_per_step, step)
        for r in requests:
            self.ledger.schedule(r.prompt_id, step)
            self.open_requests[r.prompt_id] = r
        if delay_s > 0:
            self.backoff.hold(requests, delay_s)
        else:
            self._submit(requests)

    def collect(self, step: int) -> list:
        deadline = time.monotonic() + self.collect_timeout_s
        next_poll = time.monotonic()  # at once, then every UNDELIVERED_POLL_S
        ready = self.buffer.ready(step)
        while True:
            if time.monotonic() >= next_poll:
                self.drop_undelivered()
                next_poll = time.monotonic() + UNDELIVERED_POLL_S
            for group, reason in self.buffer.screen(step, self.version):
                if reason == "too_few_valid_samples":
                    self.last_sample_error = next((t.error for t in group.trajectories if t.error),
                                                  self.last_sample_error)
                self._drop(group.prompt_id, reason, replace_for=step)
            now_ready = self.buffer.ready(step)
            if now_ready > ready:  # a group passed screening: failures are no longer in a row
                self.backoff.succeeded()
            ready = now_ready
            held = self.backoff.due()
            if held:
                self._submit(held)
            if ready >= self.n_per_step:
                return self.buffer.take(step, self.n_per_step)
            left = deadline - time.monotonic()
            if left <= 0:
                dropped = self.ledger.summary()["dropped_by_reason"]
                raise StepTimeout(f"pool {self.recipe.rollout_pool.name!r}: only {self.buffer.ready(step)}/"
                                  f"{self.n_per_step} groups for step {step} after {self.collect_timeout_s:.0f} s "
                                  f"(prompts dropped so far, by reason: {dropped or 'none'}; "
                                  f"{len(self.ledger.pending())} still pending"
                                  + (f"; last failed sample: {self.last_sample_error}" if self.last_sample_error
                                     else "") + ")")
            held_due = self.backoff.next_due_in()
            wait = min(left, 5.0) if held_due is None else min(left, 5.0, held_due)
            try:
                self._receive(self.channel.recv(max(0.01, wait)))
            except ChannelTimeout:
                if self.refit.engines_waiting():  # a restarted engine waits for our weights
                    self.push_weights(reset=True)

    def drop_undelivered(self) -> int:
        """Drop (reason ``undelivered``) and replace the open prompts whose groups the pool's engines could not
        put into this job's channel; returns how many were dropped."""
        dropped = 0
        for u in self.pool.take_undelivered.remote(self.id).result(timeout_s=60):
            pid = str(u["prompt_id"])
            if self.ledger.is_open(pid) and not self.buffer.holds(pid):
                log.warning("prompt %s (step %s) was not delivered by engine %s: %s", pid, u["scheduled_step"],
                            u.get("engine_id"), u["reason"])
                self._drop(pid, "undelivered", replace_for=int(u["scheduled_step"]))
                dropped += 1
        return dropped

    def train(self, buffered: list) -> dict:
        import ray

        # A fixed order (not arrival order): a seeded sync run then trains on the same batches, packed the same
        # way, whether or not it was killed and resumed in between.
        buffered = sorted(buffered, key=lambda b: (b.group.scheduled_step, b.group.prompt_id))
        ages = [self.version - b.group.oldest_version for b in buffered]  # version at the start of the step
        metrics = self.learner.call("train_step", [ray.put(b.data) for b in buffered])
        self.version = int(self.learner.call("version"))
        skipped = self.skips.record(metrics)  # nothing trained: the prompts are dropped (services.skips)
        for b in buffered:
            if skipped:
                self.ledger.mark_dropped(b.group.prompt_id, DROP_REASON)
            else:
                self.ledger.mark_trained(b.group.prompt_id, b.group.scheduled_step)
            self.open_requests.pop(b.group.prompt_id, None)
        metrics["trajectory_ages"] = ages
        metrics["trajectory_age_mean"] = float(np.mean(ages))
        metrics["trajectory_age_max"] = float(np.max(ages))
        return metrics

    def push_weights(self, reset: bool = False) -> dict:
        """Push the learner's version; without ``reset``, nothing (``{}``) if it was pushed already (skipped step)."""
        if not reset and self.version == self.pushed_version:
            self.last_refit = {}
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
        self.step = step
        with timer.phase("parity_probe"):
            parity = self.checked_parity()  # after a skipped step too: same weights, still a valid check
        times = timer.summary()
        times["other_s"] += times.pop("parity_probe_s", 0.0)
        row = {"step": step, "policy_version": self.version, **times}
        for k, v in metrics.items():
            if k == "gen_kl_error":
                row["train_gen_kl_error"] = v  # pi_gen vs pi_prev over the batch (includes lag-1 drift)
            elif isinstance(v, (int, float)):
                row[k] = v
        row.update(parity)
        row["refit_bytes"] = self.last_refit.get("bytes", 0)
        if "pause_seconds_max" in self.last_refit:
            row["refit_pause_s"] = self.last_refit["pause_seconds_max"]
            row["refit_install_s"] = self.last_refit["install_seconds_max"]
        row["tokens_per_s"] = metrics.get("tokens_per_s", float("nan"))
        row["buffer_groups"] = len(self.buffer)
        row.update({f"dropped_{k}": v for k, v in self.buffer.drops.items()})
        if metrics.get("step_skipped"):
            row["skip_reason"] = self.skips.last_reason
        self.log.write(row)
        report = {**row, "trajectory_ages": metrics.get("trajectory_ages", []), "rejected": dict(self.rejected)}
        self.rejected.clear()
        self.pool.report_step.remote(report)
        self.skips.check(step)  # too many skipped steps in a row stop the job, once their rows are written
        ck = self.recipe.checkpointing
        if ck.enabled and (step % ck.save_period == 0 or step == self.last_step):
            self.save_checkpoint()
        return row

    def checked_parity(self) -> dict:
        """Probe the engines (re)installed since their last probe (:mod:`services.parity`); on a failure push the
        weights once more and probe again, then stop with ``ParityError``."""
        return self.parity.checked(self.version, lambda: self.push_weights(reset=True))

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        path = self._ckpt_root() / f"step_{self.step:06d}"
        extra = {"step": self.step, "data_position": self.source.position(), "ledger": self.ledger.state(),
                 "buffer": [b.data for b in self.buffer.all_groups()],
                 "open_requests": [encode(r) for r in self.open_requests.values()],
                 "parity_set": self.parity.sequences, "drops": dict(self.buffer.drops)}
        self.learner.call("save_checkpoint", str(path), extra)
        (self._ckpt_root() / "latest").write_text(path.name)
        keep = self.recipe.checkpointing.keep_top_k
        for old in sorted(self._ckpt_root().glob("step_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def _ckpt_root(self) -> Path:
        root = Path(self.recipe.checkpointing.checkpoint_dir)
        root = root if root.is_absolute() else self.run_dir / root
        root.mkdir(parents=True, exist_ok=True)
        return root

    def _resume(self) -> None:
        marker = self._ckpt_root() / "latest"
        if not marker.exists():
            return
        path = self._ckpt_root() / marker.read_text().strip()
        extra = self.learner.call("load_checkpoint", str(path))
        self.step = int(extra["step"])
        self.version = int(self.learner.call("version"))
        self.source.seek(extra["data_position"])
        self.ledger = PromptLedger.from_state(extra["ledger"])
        for data in extra["buffer"]:
            self.buffer.add(decode(data, expect=TrajectoryGroup), data)
        self.open_requests = {r.prompt_id: r for r in (decode(b, expect=PromptRequest)
                                                       for b in extra["open_requests"])}
        self.parity.sequences = [tuple(x) for x in extra["parity_set"]]
        self.buffer.drops.update(extra.get("drops", {}))
        self._resumed_rows(self.step)
        log.info("resumed from %s at step %d, version %d", path, self.step, self.version)

    def _resumed_rows(self, step: int) -> None:
        path = self.run_dir / "metrics.jsonl"
        if path.exists():  # keep the record consistent with the checkpoint
            lines = [l for l in path.read_text().splitlines() if l.strip()]
            path.write_text("".join(l + "\n" for l in lines if json.loads(l)["step"] <= step))

    # ------------------------------------------------------------ internals
    def _submit(self, requests: list[PromptRequest]) -> None:
        self.pool.submit.remote([encode(r) for r in requests], self.group_size).result(timeout_s=120)

    def _receive(self, data: bytes) -> None:
        try:
            msg = decode(data)
        except ProtocolError as err:
            self._reject("malformed")
            log.warning("rejected a message from the pool: %s", err)
            return
        if isinstance(msg, TrajectoryGroup):
            if msg.prompt_id not in self.ledger.scheduled:
                self._reject("unexpected_group")
            elif not self.ledger.is_open(msg.prompt_id) or not self.buffer.add(msg, data):
                self._reject("duplicate")  # a re-queued prompt whose first group arrived too
        elif isinstance(msg, ControlMessage) and msg.action == "error":
            pid = str(msg.payload.get("prompt_id", ""))
            if self.ledger.is_open(pid) and not self.buffer.holds(pid):
                self._drop(pid, "generation_failed", replace_for=int(msg.payload.get("scheduled_step", self.step + 1)))
        else:
            self._reject("unexpected_kind")

    def _reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def _drop(self, prompt_id: str, reason: str, replace_for: int) -> None:
        self.ledger.mark_dropped(prompt_id, reason)
        self.open_requests.pop(prompt_id, None)
        self._reject(reason)
        self.schedule(replace_for, n=1, delay_s=self.backoff.delay_after(reason))

    def _buffered_ids(self) -> set[str]:
        return {b.group.prompt_id for b in self.buffer.all_groups()}

    def close(self) -> None:
        try:
            self.pool.detach.remote(self.id).result(timeout_s=30)
        except Exception:  # noqa: BLE001 - the pool may be gone already
            pass
        self.channel.close()
        self.log.close()

