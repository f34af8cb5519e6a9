"""What ``inflight eval`` reports: each prompt's scored answers, pass@k, a table and a JSON file.

A prompt's k answers are each scored by the recipe's reward (None: the answer failed, with its reason); an answer
is correct when its reward reaches :data:`services.job.validation.CORRECT`. pass@j for j <= k is the unbiased
estimator of Chen et al. (2021), ``1 - C(n - c, j) / C(n, j)`` over the n scored answers of a prompt, c of them
correct, averaged over the prompts with at least j scored answers; a failed answer is counted apart
(``failed_samples``), never as wrong, as validation does (:mod:`services.job.validation`).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.job.validation import CORRECT


@dataclass(frozen=True)
class PromptResult:
    """One prompt's answers."""

    prompt_id: str
    rewards: list[float | None]
    """Each answer's reward, in sample order; None for an answer that failed."""
    answers: list[str] = field(default_factory=list)
    """Each answer's text (empty for a failed one)."""
    failures: list[str] = field(default_factory=list)
    """Why each failed answer failed (one per None in ``rewards``; the whole group's reason when it never came)."""

    @property
    def scored(self) -> list[float]:
        return [r for r in self.rewards if r is not None]

    @property
    def correct(self) -> int:
        return sum(r >= CORRECT for r in self.scored)


def pass_at(n: int, c: int, j: int) -> float:
    """The unbiased pass@j of one prompt with ``n`` scored answers, ``c`` of them correct (``j <= n``)."""
    if not 1 <= j <= n or not 0 <= c <= n:
        raise ValueError(f"pass@{j}: expected 1 <= j <= n and 0 <= c <= n, got n={n}, c={c}")
    if n - c < j:
        return 1.0
    return 1.0 - math.comb(n - c, j) / math.comb(n, j)


@dataclass(frozen=True)
class EvalSummary:
    """The numbers of one evaluation (the table's rows, the JSON file's ``summary``)."""

    prompts: int
    """Validation prompts asked."""
    samples: int
    """Answers asked for: prompts x k."""
    failed_samples: int
    """Answers that failed (generation, environment or reward) or never came back."""
    reward_mean: float
    """Mean reward over the scored answers (NaN if none)."""
    accuracy: float
    """Share of prompts whose first answer is correct, over those whose first answer was scored."""
    pass_at_k: dict[int, float]
    """pass@j for j = 1 and j = k (k > 1), over the prompts with at least j scored answers."""
    seconds: float
    """Wall time of the sampling and scoring (the engine's start not included)."""


def summarize(results: list[PromptResult], k: int, seconds: float) -> EvalSummary:
    """The summary of ``results`` (each with ``k`` answers asked)."""
    if k < 1:
        raise ValueError(f"--pass-k: expected >= 1, got {k}")
    scored = [r for p in results for r in p.scored]
    firsts = [p.rewards[0] for p in results if p.rewards and p.rewards[0] is not None]
    nan = float("nan")
    passes: dict[int, float] = {}
    for j in sorted({1, k}):
        eligible = [p for p in results if len(p.scored) >= j]
        passes[j] = (sum(pass_at(len(p.scored), p.correct, j) for p in eligible) / len(eligible)
                     if eligible else nan)
    return EvalSummary(prompts=len(results), samples=len(results) * k,
                       failed_samples=len(results) * k - len(scored),
                       reward_mean=sum(scored) / len(scored) if scored else nan,
                       accuracy=sum(r >= CORRECT for r in firsts) / len(firsts) if firsts else nan,
                       pass_at_k=passes, seconds=seconds)


def table(summary: EvalSummary, title: str) -> str:
    """The summary as a two-column Markdown table under ``title``."""
    rows = [("prompts", str(summary.prompts)), ("samples", str(summary.samples)),
            ("failed samples", str(summary.failed_samples)), ("mean reward", _num(summary.reward_mean)),
            ("accuracy (first answer)", _num(summary.accuracy))]
    rows += [(f"pass@{j}", _num(v)) for j, v in sorted(summary.pass_at_k.items())]
    rows.append(("seconds", f"{summary.seconds:.1f}"))
    width = max(len(name) for name, _ in rows)
    lines = [title, f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    return "\n".join(lines)


def write_json(path: str | Path, summary: EvalSummary, results: list[PromptResult], about: dict) -> Path:
    """Write ``{"about": ..., "summary": ..., "prompts": [...]}`` to ``path`` (NaN as null); returns the path."""
    s = asdict(summary)
    s["pass_at_k"] = {str(j): v for j, v in summary.pass_at_k.items()}
    doc = {"about": about, "summary": _no_nan(s), "prompts": [_no_nan(asdict(p)) for p in results]}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return out


def _num(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.4f}"


def _no_nan(v):
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _no_nan(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_no_nan(x) for x in v]
    return v
