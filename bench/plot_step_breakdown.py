"""Stacked bars of step-time breakdowns (bench/step_breakdown.py results), one bar per run and mode.

    python bench/plot_step_breakdown.py OUT.png LABEL=RESULT.json [LABEL=RESULT.json ...]

Each bar splits the mean warm step into policy training, generation exposed,
refit and other; the overlap efficiency of the async run is printed above it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PARTS = [("policy_training_s", "policy training", "#4c72b0"), ("generation_exposed_s", "generation exposed", "#dd8452"),
         ("refit_s", "refit", "#c44e52"), ("other_s", "other", "#8c8c8c")]


def main() -> None:
    if len(sys.argv) < 3 or any("=" not in a for a in sys.argv[2:]):
        raise SystemExit(__doc__)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = []
    for arg in sys.argv[2:]:
        label, path = arg.split("=", 1)
        data = json.loads(Path(path).read_text())
        for mode in ("sync", "async"):
            bars.append((f"{label}\n{mode}", data["results"][mode],
                         data["overlap_efficiency"] if mode == "async" else None))
    fig, ax = plt.subplots(figsize=(1.9 * len(bars) + 1.5, 4.2))
    for i, (_, r, overlap) in enumerate(bars):
        bottom = 0.0
        for key, name, color in PARTS:
            ax.bar(i, r[key], bottom=bottom, color=color, label=name if i == 0 else None, width=0.6)
            bottom += r[key]
        note = f"{r['step_s']:.2f} s" + (f"\noverlap {overlap:.2f}" if overlap is not None else "")
        ax.text(i, bottom + 0.2, note, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("seconds per step (mean of warm steps)")
    ax.set_ylim(0, max(b[1]["step_s"] for b in bars) * 1.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=120)
    print(f"wrote {sys.argv[1]}")


if __name__ == "__main__":
    main()
