"""Time to first batch and peak memory of the training data path for a 1,000,000-row JSONL (generated in a temp dir):
the datasets-backed :class:`PromptSource` (memory-mapped Arrow, rows tokenized when drawn) against the same rows read
by ``json.loads`` per line into a list (then the same first batch tokenized).

Each variant runs in a fresh child process (its peak RSS is ``ru_maxrss`` of that process, which includes the
interpreter and the imports; the ``baseline`` row is a child that only imports, and ``over baseline`` is the
difference). The datasets variant runs twice:
``cold`` converts the JSONL to Arrow (the ``datasets`` cache, in the temp dir), ``warm`` finds the conversion cached
(a restarted or resumed run).

    .venv/bin/python bench/data_loading.py [--rows 1000000] [--batch 64]
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "data_loading.json"


def write_rows(path: Path, n: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            f.write(json.dumps({"input": f"Problem {i}: what is {a} plus {b}?", "output": str(a + b),
                                "difficulty": i % 3, "source": "bench"}) + "\n")


def _tokenizer():
    from transformers import AutoTokenizer

    from services.models.source import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny://qwen2"))


def worker(kind: str, path: str, batch: int, cache: str) -> dict:
    """Runs in the child: imports (``datasets`` too, in every variant, so that the RSS rows differ by the data
    alone), then the clock starts; loads and draws one batch of ``batch`` prompts."""
    import datasets  # noqa: F401
    import numpy as np

    from protocol import PromptRequest
    from services.data.tasks import chat_prompt_ids
    from services.data.dataset import RowMapper, load_rows
    from services.data.prompt_source import PromptSource, RowPrompts
    from services.data.prompt_template import PromptTemplate

    tokenizer = _tokenizer()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if kind == "baseline":
        n = 0
    elif kind == "json_loads":
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        n = len(rows)
        order = np.random.default_rng([0, 0]).permutation(n)
        first = [PromptRequest(f"row-{i}", np.asarray(chat_prompt_ids(tokenizer, rows[i]["input"])),
                               {"answer": rows[i]["output"]}) for i in order[:batch]]
        assert len(first) == batch
    else:
        rows_ = load_rows(path, cache_dir=cache)
        mapper = RowMapper("input", "output", "messages")
        mapper.check_columns(rows_, "data.train_data_path")
        source = PromptSource(RowPrompts(rows_, mapper, PromptTemplate(tokenizer), 4096), seed=0)
        n = len(source)
        assert len(source.next(batch, 1)) == batch
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"kind": kind, "rows": n, "first_batch_s": round(seconds, 3), "peak_rss_mib": round(peak / 1024, 1),
            "rss_before_load_mib": round(rss0 / 1024, 1)}


def run_child(kind: str, path: Path, batch: int, cache: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", kind, "--path", str(path), "--batch", str(batch),
                          "--cache", str(cache)], capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode:
        raise RuntimeError(f"{kind}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--worker", choices=["baseline", "json_loads", "datasets"])
    ap.add_argument("--path")
    ap.add_argument("--cache")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.path, args.batch, args.cache)))
        return
    with tempfile.TemporaryDirectory(prefix="inflight-bench-data-") as tmp:
        path, cache = Path(tmp) / "rows.jsonl", Path(tmp) / "hf-cache"
        t = time.perf_counter()
        write_rows(path, args.rows)
        print(f"wrote {args.rows} rows ({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t:.1f} s")
        results = [run_child("baseline", path, args.batch, cache), run_child("json_loads", path, args.batch, cache)]
        cold = run_child("datasets", path, args.batch, cache)
        warm = run_child("datasets", path, args.batch, cache)
        results += [{**cold, "kind": "datasets (cold: JSONL -> Arrow)"}, {**warm, "kind": "datasets (warm cache)"}]
        size_mib = path.stat().st_size / 2**20
    base = results[0]["peak_rss_mib"]
    for r in results:
        r["over_baseline_mib"] = round(r["peak_rss_mib"] - base, 1)
    print(f"\n{'variant':34} {'rows':>9} {'first batch s':>14} {'peak RSS MiB':>13} {'over baseline':>14}")
    for r in results:
        print(f"{r['kind']:34} {r['rows']:>9} {r['first_batch_s']:>14.2f} {r['peak_rss_mib']:>13.0f} "
              f"{r['over_baseline_mib']:>14.0f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": args.rows, "file_mib": round(size_mib, 1), "batch": args.batch,
                                   "results": results}, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
