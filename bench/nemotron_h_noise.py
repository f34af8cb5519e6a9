"""Why a push into a running NemotronH engine scored up to 0.4 nats off a freshly started engine at 1.7B (issue 34):
install error or the engine's own run-to-run noise.

One engine is started on B (a fresh load). It answers the repeat-letter prompts greedily, then scores those answers
(``RolloutEngine.logprobs_of``: prompt log-probs, prefix cache not read) four times: all requests submitted
together, twice (the batches the scheduler forms then depend on when each request reaches the engine core), and
one request at a time, twice (every forward pass has the same shape in every run). A fingerprint of every tensor
the model holds is taken. Then A is pushed and B pushed back through ``RolloutEngine.install`` (staged, then
vLLM's layerwise ``reload_weights``), and the same scores and fingerprint are taken again. With ``--second-engine``
an engine started on A takes B (the comparison of ``nemotron_h_gpu.py install``) and is scored one request at a
time too.

If the install is right, the tensors are equal and the one-at-a-time scores are bit-equal, while the scores of
requests submitted together differ between two runs of the same engine on the same weights by about what the
install seemed to cost.

    python bench/nemotron_h_noise.py /tmp/models/nemotron-h-a /tmp/models/nemotron-h-b --out noise.json
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
from nemotron_h_gpu import Served, object_store_push


def together(served: Served, prompts, answers) -> list[np.ndarray]:
    """Scores of every request, all submitted at once."""
    return served.logprobs(prompts, answers)


def alone(served: Served, prompts, answers) -> list[np.ndarray]:
    """Scores of every request, one request in the engine at a time."""
    return [served.logprobs([p], [a])[0] for p, a in zip(prompts, answers, strict=True)]


def gap(x: list[np.ndarray], y: list[np.ndarray]) -> dict:
    """Max and mean |difference| of two score lists, and how many requests differ at all."""
    d = [np.abs(p - q) for p, q in zip(x, y, strict=True)]
    return {"max": float(max(v.max() for v in d)), "mean": float(np.concatenate(d).mean()),
            "requests_differing": sum(bool(v.any()) for v in d)}


def scores(served: Served, prompts, answers) -> dict[str, list[np.ndarray]]:
    return {"together_1": together(served, prompts, answers), "together_2": together(served, prompts, answers),
            "alone_1": alone(served, prompts, answers), "alone_2": alone(served, prompts, answers)}


def push(served: Served, model_dir: str, version: int) -> float:
    import time

    (manifest, buckets), _ = object_store_push(model_dir, version)
    t0 = time.perf_counter()
    assert served.run(served.engine.install(manifest, buckets)) == version
    return round(time.perf_counter() - t0, 3)


def differing(f: dict, g: dict) -> list[str]:
    return sorted(n for n in f.keys() | g.keys() if f.get(n) != g.get(n))


def noise_check(a: str, b: str, args, save=lambda result: None) -> dict:
    """The checks of the module docstring; ``save`` gets the result so far after each engine (a call that runs out
    of time during the second engine keeps the first's numbers)."""
    from services.data.tasks import make_prompts

    out: dict = {"model_a": a, "model_b": b}
    served = Served(b, args)
    try:
        requests = make_prompts("repeat_letter", served.engine.tokenizer, args.prompts, seed=0)
        prompts = [r.prompt_ids.tolist() for r in requests]
        answers, _ = served.greedy(requests)
        out.update(prompts=len(prompts), answer_tokens=sum(map(len, answers)),
                   engine_b_start_s=round(served.start_s, 1))
        fresh = scores(served, prompts, answers)
        fresh_tensors = served.fingerprint()
        out["install_a_s"] = push(served, a, 1)
        on_a = alone(served, prompts, answers)
        out["install_b_back_s"] = push(served, b, 2)
        back = scores(served, prompts, answers)
        back_tensors = served.fingerprint()
    finally:
        served.close()
    out["model_tensors"] = len(fresh_tensors)
    out["fresh_engine"] = {"together_1_vs_together_2": gap(fresh["together_1"], fresh["together_2"]),
                           "alone_1_vs_alone_2": gap(fresh["alone_1"], fresh["alone_2"]),
                           "together_1_vs_alone_1": gap(fresh["together_1"], fresh["alone_1"]),
                           "together_2_vs_alone_1": gap(fresh["together_2"], fresh["alone_1"])}
    out["a_installed_vs_fresh_b_alone"] = gap(on_a, fresh["alone_1"])
    out["b_pushed_back"] = {"tensors_differing_from_fresh": differing(fresh_tensors, back_tensors),
                            "alone_vs_fresh_alone": gap(back["alone_1"], fresh["alone_1"]),
                            "alone_1_vs_alone_2": gap(back["alone_1"], back["alone_2"]),
                            "together_vs_fresh_together": gap(back["together_1"], fresh["together_1"]),
                            "together_1_vs_together_2": gap(back["together_1"], back["together_2"])}
    save(out)
    if args.second_engine:
        served = Served(a, args)
        try:
            out["engine_a_start_s"] = round(served.start_s, 1)
            out["second_engine_install_b_s"] = push(served, b, 1)
            second = {"alone_1": alone(served, prompts, answers), "together_1": together(served, prompts, answers)}
            second_tensors = served.fingerprint()
        finally:
            served.close()
        out["a_engine_plus_b"] = {"tensors_differing_from_fresh": differing(fresh_tensors, second_tensors),
                                  "alone_vs_fresh_alone": gap(second["alone_1"], fresh["alone_1"]),
                                  "together_vs_fresh_together": gap(second["together_1"], fresh["together_1"])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--precision", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (a CPU smoke run)")
    ap.add_argument("--second-engine", action="store_true", help="also start an engine on A and push B into it")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the fingerprint reader runs on the worker
    def save(result: dict) -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")

    result = noise_check(args.a, args.b, args, save)
    save(result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
