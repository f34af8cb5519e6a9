"""Images per second of the image preparation path (read, validate, resize, patchify: services/data/images.py) in process
and in the worker pool (services/data/image_pool.py) with 1, 2, 4 and 8 workers, on the same images: the seed's
serial-vs-parallel comparison of image encoding.

Two workloads, each of ``--images`` distinct PNG scenes drawn by scripts/make_clevr.py (in a temp dir, read from
disk by path as a data set's rows would be):

- ``clevr-tiny``: the generator's scenes (64-320 pixels a side) under the tiny VLM's rules (4-16 image tokens);
- ``clevr-480x320``: the scenes resized to CLEVR's own 480 x 320 under Qwen2.5-VL's published rules
  (``max_pixels`` 12845056: 476 x 308 after the resize, 187 image tokens, 3.5 MB of float32 patches each).

Each setting runs ``--repeats`` times over the whole set and keeps the median; a pool is started and warmed (two
images per worker, then a pause for the workers' initializers) before its clock starts, and its start-up is reported
apart. The worker count is not capped at the machine's cores: the output says how many there are, and rows beyond
them measure contention, not scaling. The CPU time per image (this process and the workers, user + system) depends
much less than the wall time on what else the machine runs: it is the cost of the path, and the caller's share
bounds what one caller can take in (1000 / that many images/s).

    .venv/bin/python bench/image_prep.py [--images 256] [--repeats 3] [--vlm-metrics RUN/metrics.jsonl]

``--vlm-metrics`` adds one VLM step's breakdown (means over the warm steps of a run of
``recipes/clevr-tiny-cpu.yaml``: policy training, exposed generation, refit, other) to the output and the JSON.
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "image_prep_cpu.json"
WORKERS = (1, 2, 4, 8)


def _clevr():
    spec = importlib.util.spec_from_file_location("make_clevr", ROOT / "scripts" / "make_clevr.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_clevr"] = module
    spec.loader.exec_module(module)
    return module


def write_images(out: Path, n: int, size: tuple[int, int] | None) -> list[str]:
    """``n`` distinct scenes as PNG files (resized to ``size`` when given); their paths."""
    from PIL import Image

    clevr, rng, paths = _clevr(), random.Random(0), []
    out.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        png = clevr.draw(*clevr.scene(rng, "A", 6))
        if size is not None:
            buf = io.BytesIO()
            Image.open(io.BytesIO(png)).resize(size).save(buf, format="PNG")
            png = buf.getvalue()
        path = out / f"{k:05d}.png"
        path.write_bytes(png)
        paths.append(str(path))
    return paths


def cpu_seconds() -> tuple[float, float]:
    """CPU time (user + system) of this process and of its live children (the pool's workers)."""
    me = psutil.Process()
    own = sum(me.cpu_times()[:2])
    return own, sum(sum(c.cpu_times()[:2]) for c in me.children(recursive=True))


def run_serial(paths: list[str], rules, repeats: int) -> tuple[list[float], float]:
    """Seconds of each repeat, and the CPU seconds of all of them."""
    from services.data.images import PreparedImage, prepare_image

    times, cpu0 = [], cpu_seconds()[0]
    for _ in range(repeats):
        t = time.perf_counter()
        out = [prepare_image(p, rules, base_dir=os.path.dirname(p)) for p in paths]
        times.append(time.perf_counter() - t)
        assert all(isinstance(o, PreparedImage) for o in out)
    return times, cpu_seconds()[0] - cpu0


def run_pool(paths: list[str], rules, workers: int, repeats: int) -> tuple[float, list[float], float, float]:
    """The pool's start-up (spawn + warm-up), the seconds of each repeat over ``paths``, and the CPU seconds of all
    repeats in this process and in the workers."""
    from services.data.image_pool import ImagePool

    t = time.perf_counter()
    with ImagePool(rules, num_workers=workers) as pool:
        pool.prepare(paths[: 2 * workers], os.path.dirname(paths[0]))
        start = time.perf_counter() - t
        time.sleep(0.5 + 0.25 * workers)  # every worker has run its initializer (they start together, 2 cores)
        times, (own0, kids0) = [], cpu_seconds()
        for _ in range(repeats):
            t = time.perf_counter()
            pool.prepare(paths, os.path.dirname(paths[0]))
            times.append(time.perf_counter() - t)
        own1, kids1 = cpu_seconds()
        assert not pool.counts.failed, pool.counts
    return start, times, own1 - own0, kids1 - kids0


def bench_workload(name: str, paths: list[str], rules, repeats: int) -> dict:
    from services.data.images import PreparedImage, batch_images, prepare_image

    prepared = [prepare_image(p, rules, base_dir=os.path.dirname(p)) for p in paths]
    assert all(isinstance(p, PreparedImage) for p in prepared)
    batch = batch_images(prepared)  # type: ignore[arg-type]
    n = len(paths) * repeats
    times, cpu = run_serial(paths, rules, repeats)
    med = statistics.median(times)
    rows = [{"workers": 0, "label": "in process", "images_per_s": round(len(paths) / med, 1),
             "median_s": round(med, 4), "all_s": [round(x, 4) for x in times], "start_s": 0.0,
             "cpu_ms_per_image": round(1e3 * cpu / n, 2), "caller_cpu_ms_per_image": round(1e3 * cpu / n, 2)}]
    for w in WORKERS:
        start, times, own, kids = run_pool(paths, rules, w, repeats)
        med = statistics.median(times)
        rows.append({"workers": w, "label": f"{w} worker{'s' if w > 1 else ''}",
                     "images_per_s": round(len(paths) / med, 1), "median_s": round(med, 4),
                     "all_s": [round(x, 4) for x in times], "start_s": round(start, 3),
                     "cpu_ms_per_image": round(1e3 * (own + kids) / n, 2),
                     "caller_cpu_ms_per_image": round(1e3 * own / n, 2)})
    for r in rows:
        r["vs_in_process"] = round(r["images_per_s"] / rows[0]["images_per_s"], 2)
        r["vs_1_worker"] = round(r["images_per_s"] / rows[1]["images_per_s"], 2)
    tokens = [p.num_tokens for p in prepared]  # type: ignore[union-attr]
    return {"workload": name, "images": len(paths), "rules": {"min_pixels": rules.min_pixels,
                                                               "max_pixels": rules.max_pixels},
            "mean_png_bytes": round(statistics.mean(os.path.getsize(p) for p in paths)),
            "image_tokens": {"min": min(tokens), "mean": round(statistics.mean(tokens), 1), "max": max(tokens)},
            "distinct_grids": len({tuple(p.image_grid_thw) for p in prepared}),  # type: ignore[union-attr]
            "padding_share_if_padded": round(batch.padding_share, 3),
            "mean_pixel_values_mb": round(batch.pixel_values.nbytes / len(paths) / 1e6, 3), "rows": rows}


def vlm_step_breakdown(metrics: Path) -> dict:
    """One VLM step, broken down: the warm-step means of a run's metrics (bench/step_breakdown.py's summary)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_breakdown import summarize

    out = summarize(metrics)
    print(f"\nVLM step ({metrics}, {out['steps']} steps, warm means): total {out['step_s']:.2f} s, policy training "
          f"{out['policy_training_s']:.2f} s, generation exposed {out['generation_exposed_s']:.2f} s, refit "
          f"{out['refit_s']:.2f} s")
    return out


def main() -> None:
    from services.data.images import ImageRules

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vlm-metrics", type=Path, default=None, help="a VLM run's metrics.jsonl: its step breakdown")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    machine = {"cores_usable": cores, "cpu_count": os.cpu_count(), "platform": platform.platform(),
               "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
               "load_average_before": [round(x, 2) for x in os.getloadavg()]}
    print(f"machine: {cores} usable CPU cores (os.cpu_count() {os.cpu_count()}), load average "
          f"{machine['load_average_before']}; worker counts above {cores} measure contention, not scaling")
    workloads = {"clevr-tiny": (None, ImageRules(min_pixels=4 * 784, max_pixels=16 * 784)),
                 "clevr-480x320": ((480, 320), ImageRules())}
    results = []
    with tempfile.TemporaryDirectory(prefix="inflight-bench-images-") as tmp:
        for name, (size, rules) in workloads.items():
            paths = write_images(Path(tmp) / name, args.images, size)
            res = bench_workload(name, paths, rules, args.repeats)
            results.append(res)
            print(f"\n{name}: {res['images']} images, {res['mean_png_bytes']} PNG bytes and "
                  f"{res['image_tokens']['mean']} image tokens on average, {res['distinct_grids']} grid shapes "
                  f"(padding every image to the largest would waste {res['padding_share_if_padded']:.0%})")
            print(f"{'':14} {'images/s':>9} {'vs in process':>14} {'vs 1 worker':>12} {'pool start s':>13} "
                  f"{'CPU ms/image':>13} {'of it caller':>13}")
            for r in res["rows"]:
                print(f"{r['label']:14} {r['images_per_s']:>9.0f} {r['vs_in_process']:>14.2f} "
                      f"{r['vs_1_worker']:>12.2f} {r['start_s']:>13.2f} {r['cpu_ms_per_image']:>13.2f} "
                      f"{r['caller_cpu_ms_per_image']:>13.2f}")
    vlm_step = vlm_step_breakdown(args.vlm_metrics) if args.vlm_metrics else None
    machine["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine, "repeats": args.repeats,
                                   "workloads": results, "vlm_step": vlm_step}, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
