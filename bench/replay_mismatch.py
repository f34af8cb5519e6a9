"""Engine-vs-learner mismatch of runs with routing replay off and on, from their metrics.jsonl (issue 37).

    python3 bench/replay_mismatch.py --run off=RUN_A/metrics.jsonl --run on=RUN_B/metrics.jsonl --out F.json

Prints one row per run: the mean over its steps (and the largest step value) of gen KL, token_mult_prob_error and
the per-sequence mismatch statistics (docs/learner.md, "Seeing the mismatch"), with the routing replay counters
where the learner reported them; writes the same as JSON. ``gpu_session.sh`` R and S write such runs.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

KEYS = ("gen_kl_error", "token_mult_prob_error", "logprob_mismatch_mean", "logprob_mismatch_max",
        "logprob_mismatch_token_max", "logprob_mismatch_over_threshold_share", "logprob_mismatch_sequences")


def step_rows(path: Path) -> list[dict]:
    """The training steps' rows of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("step", 0) >= 1 and "gen_kl_error" in r]


def summary(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Key -> mean and max over the steps, for :data:`KEYS` and the learner's ``router_replay_*`` counters."""
    keys = list(KEYS) + sorted({k for r in rows for k in r if k.startswith("router_replay_")})
    out: dict[str, dict[str, float]] = {}
    for key in keys:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
        if values:
            out[key] = {"mean": sum(values) / len(values), "max": max(values)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, metavar="NAME=METRICS_JSONL")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    table: dict[str, dict] = {}
    for spec in args.run:
        name, _, path = spec.partition("=")
        rows = step_rows(Path(path))
        table[name] = {"steps": [r["step"] for r in rows], **summary(rows)}
    print(f"{'metric (mean over steps, max)':<44}" + "".join(f"{name:>26}" for name in table))
    for key in dict.fromkeys(k for t in table.values() for k in t if k != "steps"):
        cells = [f"{t[key]['mean']:.4g} ({t[key]['max']:.4g})" if key in t else "-" for t in table.values()]
        print(f"{key:<44}" + "".join(f"{c:>26}" for c in cells))
    if args.out:
        args.out.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
