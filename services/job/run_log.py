"""Per-step metrics of a run: ``metrics.jsonl``, TensorBoard, the seed's two
summary tables and a reward-curve PNG.

``metrics.jsonl`` is the record: a resumed run appends to it after dropping
the rows past its checkpoint (:meth:`RunLog.truncate_after`).

Timing means are over warm steps (step 1 is dropped when there are more), as
in the seed's write-up. A validation before the first step (``grpo.val_at_start``)
is the row of step 0: its ``val_*`` keys only; the summaries count training rows
(step >= 1) and the PNG draws it on the validation curve. TensorBoard, W&B and MLflow (:mod:`services.job.sinks`) are
optional: if one cannot start or a write fails, one warning says why and the run goes on with the other sinks
(``metrics.jsonl`` is the record).
"""
from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.job.sinks import Sink, sink_factories

if TYPE_CHECKING:
    from services.recipe.logger import LoggerConfig

log = logging.getLogger("inflight.run_log")

TIMING_COLUMNS = [("Total step", "step_s"), ("Policy training", "policy_training_s"),
                  ("Generation exposed", "generation_exposed_s"), ("Refit", "refit_s"), ("Other", "other_s")]


class StepTimer:
    """Wall time of one step split into named phases; ``other`` is the rest."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t

    def summary(self) -> dict[str, float]:
        total = time.perf_counter() - self.t0
        out = {f"{k}_s": v for k, v in self.phases.items()}
        for k in ("policy_training_s", "generation_exposed_s", "refit_s"):
            out.setdefault(k, 0.0)
        out["step_s"] = total
        out["other_s"] = max(0.0, total - sum(self.phases.values()))
        return out


class RunLog:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, loggers: LoggerConfig | None = None,
                 params: dict[str, Any] | None = None):
        """``loggers`` (the recipe's ``logger``) enables W&B and MLflow; ``params`` (the recipe) is their run
        config."""
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.rows: list[dict] = []
        if self.path.exists():  # a resumed run appends
            self.rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        self._sinks: list[Sink] = []
        for name, make in sink_factories(self.dir, tensorboard, loggers, params or {}):
            try:
                self._sinks.append(make())
            except Exception as exc:  # noqa: BLE001 - every sink is optional; metrics.jsonl is the record
                self._sink_failed(name, "could not start", exc)

    def truncate_after(self, step: int) -> None:
        """Forget the rows after ``step`` (a resume from that step's checkpoint): the record stays consistent
        with the checkpoint."""
        if self.path.exists():
            lines = [line for line in self.path.read_text().splitlines() if line.strip()]
            self.path.write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= step))
        self.rows = [r for r in self.rows if r["step"] <= step]

    def write(self, row: dict) -> None:
        """Append ``row`` to metrics.jsonl and give its finite numbers, at ``row["step"]``, to every sink."""
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        scalars = {k: float(v) for k, v in row.items()
                   if isinstance(v, (int, float)) and math.isfinite(v) and k != "step"}
        for sink in list(self._sinks):
            try:
                sink.write(row["step"], scalars)
            except Exception as exc:  # noqa: BLE001 - reported once; metrics.jsonl has the row
                self._sink_failed(sink.name, f"failed writing step {row['step']}", exc, sink)

    def _sink_failed(self, name: str, what: str, exc: Exception, sink: Sink | None = None) -> None:
        log.warning("run log %s: %s %s (%s: %s); it is off for the rest of the run, metrics.jsonl "
                    "goes on", self.dir, name, what, type(exc).__name__, exc)
        if sink in self._sinks:
            self._sinks.remove(sink)

    def close(self) -> None:
        """Close every sink (the W&B and MLflow runs end here)."""
        for sink in list(self._sinks):
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - the run is over; metrics.jsonl is complete
                self._sink_failed(sink.name, "failed closing", exc, sink)
        self._sinks = []

    # ------------------------------------------------------------ summaries
    def training_rows(self) -> list[dict]:
        """The rows of training steps (not the step-0 validation row)."""
        return [r for r in self.rows if r["step"] >= 1]

    def warm_rows(self) -> list[dict]:
        rows = self.training_rows()
        return rows[1:] if len(rows) > 1 else rows

    def timing_table(self, label: str) -> str:
        rows = self.warm_rows()
        head = f"| Configuration | {' | '.join(c for c, _ in TIMING_COLUMNS)} |"
        cells = [f"{_mean(rows, k):.2f}s" for _, k in TIMING_COLUMNS]
        return "\n".join([head, "|" + "---|" * (len(TIMING_COLUMNS) + 1), f"| {label} | {' | '.join(cells)} |"])

    def validation_table(self, label: str) -> str:
        rows = self.training_rows()
        cols = [("Steps", str(len(rows))), ("Mean reward", f"{_mean(rows, 'reward_mean'):.4f}"),
                ("Mean gen KL", f"{_mean(rows, 'gen_kl_error'):.2e}"),
                ("Max gen KL", f"{_max(rows, 'gen_kl_error'):.2e}"),
                ("Mean policy KL", f"{_mean(rows, 'policy_kl_error'):.2e}"),
                ("Max policy KL", f"{_max(rows, 'policy_kl_error'):.2e}"),
                ("Mean prob. ratio", f"{_mean(rows, 'probs_ratio_mean'):.9f}"),
                ("Mean trajectory age", f"{_mean(self.warm_rows(), 'trajectory_age_mean'):.2f}")]
        head = "| Recipe | " + " | ".join(c for c, _ in cols) + " |"
        body = f"| {label} | " + " | ".join(v for _, v in cols) + " |"
        return "\n".join([head, "|" + "---|" * (len(cols) + 1), body])

    def plot_rewards(self, path: str | Path | None = None) -> Path:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path or self.dir / "reward_curve.png")
        train = self.training_rows()
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        ax.plot([r["step"] for r in train], [r.get("reward_mean", float("nan")) for r in train], marker="o", ms=3,
                label="training reward")
        val = [r for r in self.rows if isinstance(r.get("val_reward_mean"), (int, float))]
        if val:
            ax.plot([r["step"] for r in val], [r["val_reward_mean"] for r in val], marker="s", ms=4,
                    label="validation reward")
            if any(isinstance(r.get("val_accuracy"), (int, float)) for r in val):
                ax.plot([r["step"] for r in val], [r.get("val_accuracy", float("nan")) for r in val], marker="^",
                        ms=4, ls="--", label="validation accuracy")
            ax.legend(fontsize=7)
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        ax.set_title(f"Reward curve ({self.dir.name})")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path


def _vals(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def _mean(rows: list[dict], key: str) -> float:
    v = _vals(rows, key)
    return sum(v) / len(v) if v else float("nan")


def _max(rows: list[dict], key: str) -> float:
    v = _vals(rows, key)
    return max(v) if v else float("nan")
