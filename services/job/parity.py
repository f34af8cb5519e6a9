"""The parity rule (design §3, invariant 1): after a weight push the engines serve the learner's weights.

A fixed set of sequences (:func:`fixed_sequences`, built before the first step and kept in checkpoints)
is scored by the learner and by every engine (re)installed since its last probe: its install generation
(incarnation and count of installed pushes) changed. With none owing one, one engine is probed in turn.
The worst engine's gen KL ``mean(exp(d) - 1 - d)`` (d = engine - learner log-prob per token) must stay
under ``logger.parity_max_gen_kl`` and ``logger.parity_max_gen_kl_ratio`` x the median of the last
accepted probes. A failed probe pushes once more and probes again, then stops with :class:`ParityError`;
a probe with no tokens or no engine fails too: silence is not parity. The metrics it adds to a step's
row are listed in ``docs/architecture.md``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from protocol import PromptRequest, encode
from protocol.images import PromptImage
from protocol.pool_client import PoolClient
from protocol.pool_replies import EngineStatsReply

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from services.job.learner_group import LearnerGroup
    from services.recipe.config import LoggerConfig

log = logging.getLogger("inflight.parity")
Sequences = list[tuple[list[int], list[int]]]
PARITY_HISTORY = 5
"""Accepted probes whose median gen KL is the baseline of ``logger.parity_max_gen_kl_ratio``."""
PARITY_RATIO_FLOOR = 1e-6
"""The baseline is at least this, so that float32 noise (~1e-11) never makes a jump."""
CONTINUATION_TOKENS = 32
"""Tokens of the fixed continuation scored after each probe prompt."""
PROBE_TIMEOUT_S = 300.0


class ParityError(RuntimeError):
    """After a refit the engines' log-probs disagree with the learner's beyond ``logger.parity_max_gen_kl``, or the
    probe could not measure them (no tokens, no engine)."""

    def __init__(self, message: str, gen_kl: float | None = None):
        super().__init__(message)
        self.gen_kl = gen_kl
        """The gen KL the probe measured (None: it measured none)."""


def parity_stats(engine: list, learner: list) -> dict:
    """gen KL (``mean(exp(d) - 1 - d)``, d = engine - learner log-prob) and the absolute differences; raises
    :class:`ParityError` if there is no token to compare or the two sides scored different lengths."""
    if len(engine) != len(learner) or any(len(e) != len(lp) for e, lp in zip(engine, learner, strict=False)):
        raise ParityError(f"parity probe: the engine scored {[len(e) for e in engine]} tokens per sequence, the "
                          f"learner {[len(lp) for lp in learner]}")
    if not sum(len(e) for e in engine):
        raise ParityError("parity probe had no tokens to compare (empty parity set or empty responses): "
                          "it cannot say whether the engines serve the learner's weights")
    d = (np.concatenate([np.asarray(x, np.float64) for x in engine])
         - np.concatenate([np.asarray(x, np.float64) for x in learner]))
    return {"gen_kl_error": float(np.mean(np.exp(d) - 1.0 - d)), "parity_max_abs_logprob_diff": float(np.abs(d).max()),
            "parity_mean_abs_logprob_diff": float(np.abs(d).mean())}


def check_parity(stats: dict, max_gen_kl: float, version: int, history: Sequence[float] = (),
                 max_ratio: float = 0.0) -> None:
    """Raise :class:`ParityError` if ``stats`` (from :func:`parity_stats` or :meth:`ParityProbe.measure`) exceed
    ``max_gen_kl``, or, with ``max_ratio`` and a ``history`` of accepted gen KLs, ``max_ratio`` x their median
    (at least :data:`PARITY_RATIO_FLOOR`): a wrong install can stay under any absolute limit on a model with
    near-uniform outputs, yet it jumps by orders of magnitude over the run's own level."""
    if "gen_kl_error" not in stats:
        raise ParityError(f"parity probe after the refit to v{version} measured nothing: {stats}")
    kl = stats["gen_kl_error"]
    baseline = max(float(np.median(history[-PARITY_HISTORY:])), PARITY_RATIO_FLOOR) if history else None
    if not kl <= max_gen_kl:  # NaN fails too
        why = f"gen KL {kl:.3g} > logger.parity_max_gen_kl {max_gen_kl:g}"
    elif max_ratio and baseline is not None and kl > max_ratio * baseline:
        why = (f"gen KL {kl:.3g} is {kl / baseline:.0f}x the median {baseline:.3g} of the last accepted refits "
               f"(logger.parity_max_gen_kl_ratio {max_ratio:g})")
    else:
        return
    where = f" on engine {stats['parity_worst_engine']}" if "parity_worst_engine" in stats else ""
    raise ParityError(f"parity probe after the refit to v{version}{where}: {why} (mean |d logprob| "
                      f"{stats['parity_mean_abs_logprob_diff']:.3g}, max {stats['parity_max_abs_logprob_diff']:.3g}): "
                      f"either the engines are not serving the learner's weights or the engine and the learner compute "
                      f"this model differently beyond the limit", gen_kl=kl)


def fixed_sequences(prompts: Sequence[Iterable[int]], n: int, max_len: int,
                    continuation_tokens: int = CONTINUATION_TOKENS,
                    leave_out: frozenset[int] = frozenset()) -> Sequences:
    """``n`` probe sequences known before the first step: prompt ``i`` followed by the first tokens of prompt
    ``i + 1`` (real token ids of the task, the same on both sides), within ``max_len`` tokens in all;
    ``leave_out``: tokens never put in a continuation (a vision-language model's image placeholders)."""
    if n and not prompts:
        raise ValueError("parity probe: no prompts to build its sequences from")
    out: Sequences = []
    for i in range(n):
        prompt = [int(t) for t in prompts[i % len(prompts)]]
        room = min(continuation_tokens, max_len - len(prompt))
        if room < 1:
            raise ValueError(f"parity probe: prompt {i % len(prompts)} has {len(prompt)} tokens, no room for a "
                             f"continuation within policy.max_total_sequence_length {max_len}")
        out.append((prompt, [int(t) for t in prompts[(i + 1) % len(prompts)] if int(t) not in leave_out][:room]))
    return out


@dataclass(frozen=True)
class EngineInstall:
    """Whether an engine can be probed now and what it has installed."""

    ready: bool
    """Up and serving the pool's version."""
    why: str
    """Why not ready ("" when ready)."""
    generation: str | None
    """``"<incarnation>:<installs>"`` (a vLLM restarted in the same process is a new incarnation); None when
    its stats are unknown."""


def engine_installs(pool: PoolClient | DeploymentHandle) -> dict[str, EngineInstall]:
    """Each engine of ``pool`` -> its :class:`EngineInstall`, from the pool's status and engine stats."""
    client = PoolClient.of(pool)
    status, stats = client.status(), client.engine_stats()
    out = {}
    for eid, state in status.engines.items():
        s = stats.get(eid) or EngineStatsReply(eid, error="no stats")
        if not state.up:
            why = "down"
        elif s.error is not None:
            why = f"stats: {s.error}"
        elif s.version != status.version:
            why = f"serves v{s.version}, the pool v{status.version}"
        else:
            why = ""
        generation = None if s.error is not None else f"{s.incarnation}:{s.refits}"
        out[eid] = EngineInstall(not why, why, generation)
    return out


class ProbeBook:
    """Which engines owe a probe: those whose install generation changed since their last accepted probe."""

    def __init__(self):
        self.probed: dict[str, str | None] = {}
        """Engine id -> its install generation at its last accepted probe."""
        self._turn = 0

    def due(self, engines: dict[str, EngineInstall]) -> tuple[list[str], dict[str, str]]:
        """(engines to probe now, engines skipped -> why) for :func:`engine_installs`' answer; with none
        owing a probe, the next ready engine in turn."""
        ready = sorted(e for e, s in engines.items() if s.ready)
        skipped = {e: s.why for e, s in sorted(engines.items()) if not s.ready}
        owed = [e for e in ready if self.probed.get(e) != engines[e].generation]
        if not owed and ready:
            owed, self._turn = [ready[self._turn % len(ready)]], self._turn + 1
        return owed, skipped

    def accept(self, generations: dict[str, str | None]) -> None:
        self.probed.update(generations)


class ParityProbe:
    """The job's probe: its sequences, the accepted history and the :class:`ProbeBook`."""

    def __init__(self, cfg: LoggerConfig, pool: PoolClient | DeploymentHandle, learner: LearnerGroup,
                 sequences: Sequences | None = None):
        """``cfg``: the recipe's ``logger`` section; ``pool``: the pool (its DeploymentHandle, or a client on it)."""
        self.cfg, self.pool, self.learner = cfg, PoolClient.of(pool), learner
        self.sequences: Sequences = list(sequences or [])
        self.images: list[list[PromptImage]] = []
        """Per sequence, its prompt's images (vision-language data; empty for text: no images anywhere)."""
        self.image_inputs: list = []
        """The learner's ``ImageInputs`` of :attr:`images` (None for a sequence without images)."""
        self.history: list[float] = []
        """gen KL of the last accepted probes (the baseline of ``logger.parity_max_gen_kl_ratio``)."""
        self.book = ProbeBook()
        self.last: dict = {}
        """The last accepted probe's stats."""

    @property
    def enabled(self) -> bool:
        return self.cfg.parity_probe_sequences > 0

    def measure(self) -> tuple[dict, dict[str, str | None]]:
        """Engine vs learner log-probs of the sequences on every engine that owes a probe; (stats, generation of
        each probed engine). Raises :class:`ParityError` if no engine could be probed."""
        if not self.sequences:
            raise ParityError("parity probe has no sequences (logger.parity_probe_sequences > 0 but the parity set "
                              "is empty)")
        prompts, responses = [p for p, _ in self.sequences], [r for _, r in self.sequences]
        engines = engine_installs(self.pool)
        targets, skipped = self.book.due(engines)
        pictures = [encode(PromptRequest(f"parity-{i}", np.asarray(p), images=im)) for i, (p, im) in
                    enumerate(zip(prompts, self.images, strict=True))] if self.images else None
        calls = {e: self.pool.start_logprobs_of(prompts, responses, e, pictures) for e in targets}
        mine = self.learner.logprobs(prompts, responses,  # while the engines score their side
                                     self.image_inputs if pictures else None)
        per_engine: dict[str, dict] = {}
        for eid, call in calls.items():
            try:
                per_engine[eid] = parity_stats(call.result(timeout_s=PROBE_TIMEOUT_S), mine)
            except ParityError:
                raise
            except Exception as exc:  # an engine that went away meanwhile is skipped, else raised
                now = engine_installs(self.pool).get(eid, EngineInstall(False, "gone", None))
                if now.ready and now.generation == engines[eid].generation:
                    raise ParityError(f"parity probe: engine {eid} did not answer: {type(exc).__name__}: "
                                      f"{exc}"[:500]) from exc
                skipped[eid] = f"went away during the probe ({now.why or 'reinstalled'})"
        if not per_engine:
            raise ParityError(f"parity probe reached no engine (skipped: {skipped or 'none listed'})")
        worst = max(per_engine, key=lambda e: (np.isnan(per_engine[e]["gen_kl_error"]), per_engine[e]["gen_kl_error"]))
        stats = {**per_engine[worst],
                 "parity_max_abs_logprob_diff": max(s["parity_max_abs_logprob_diff"] for s in per_engine.values()),
                 "parity_mean_abs_logprob_diff": max(s["parity_mean_abs_logprob_diff"] for s in per_engine.values()),
                 "parity_worst_engine": worst, "parity_engines_probed": len(per_engine),
                 "parity_engines_skipped": len(skipped),
                 "parity_gen_kl_by_engine": {e: s["gen_kl_error"] for e, s in per_engine.items()}}
        if skipped:
            log.info("parity probe skipped %s", skipped)
        return stats, {e: engines[e].generation for e in per_engine}

    def probe(self, version: int) -> dict:
        """:meth:`measure` and :func:`check_parity`; on success the probed engines are paid up."""
        stats, generations = self.measure()
        check_parity(stats, self.cfg.parity_max_gen_kl, version, self.history, self.cfg.parity_max_gen_kl_ratio)
        self.book.accept(generations)
        self.history[:] = (self.history + [stats["gen_kl_error"]])[-PARITY_HISTORY:]
        self.last = stats
        return stats

    def checked(self, version: int, push_again: Callable[[], object]) -> dict:
        """:meth:`probe`; on a :class:`ParityError` ``push_again()`` once and probe again, then give up. With
        ``logger.parity_probe_sequences`` 0 (disabled) nothing is probed: ``{"parity_engines_probed": 0}``."""
        if not self.enabled:
            return {"parity_engines_probed": 0}
        try:
            return self.probe(version)
        except ParityError as exc:
            log.warning("%s; pushing the weights again", exc)
            first = self.measured_gen_kl(exc)
            push_again()
        try:
            return self.probe(version)
        except ParityError as exc:
            if first is None or self.measured_gen_kl(exc) is None:
                raise
            raise ParityError(f"{exc} ({first:.3g} before pushing again). If an install check has proven the "
                              f"weights (a model's tensors compared with a fresh engine's), this is how far the "
                              f"engine and the learner compute this model apart: a bf16 Nemotron-H measured "
                              f"0.014-0.027 on an H200 (docs/rollout.md, 'Hybrid models'); set "
                              f"logger.parity_max_gen_kl above the measured level", gen_kl=exc.gen_kl) from exc

    @staticmethod
    def measured_gen_kl(exc: ParityError) -> float | None:
        """The gen KL a failed probe measured (None: it measured none, e.g. no engine answered)."""
        return exc.gen_kl
