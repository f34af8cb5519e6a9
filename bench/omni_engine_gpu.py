"""Start vLLM on a tiny random Nano-Omni with the engine options Inflight builds, and answer a text and an image prompt
(a quick GPU check of ``rollout.nano_omni``'s overrides on the installed vLLM, e.g. 0.25.1 on the H200s).

    python3 bench/omni_engine_gpu.py /tmp/tiny-omni        # made by `make-tiny-model --arch nemotron_h_omni`

Prints one ``OMNI_ENGINE {json}`` line: start seconds, the architecture vLLM resolved, the answers' token counts, or
the error of the step that failed.
"""
from __future__ import annotations

import json
import os
import sys
import time


def main(model: str) -> None:
    from rollout.config import VllmConfig
    from rollout.options import build_engine_options

    report: dict = {"model": model}
    opts = build_engine_options(VllmConfig(enforce_eager=True, gpu_memory_utilization=0.3), model, 2048)
    os.environ.update(opts.env)
    report["hf_overrides"] = opts.engine_args.get("hf_overrides")
    from PIL import Image
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    try:
        llm = LLM(**opts.engine_args)
    except Exception as err:  # the failure is the measurement
        report["start_error"] = f"{type(err).__name__}: {err}"[:2000]
        print("OMNI_ENGINE", json.dumps(report), flush=True)
        raise
    report["start_s"] = round(time.perf_counter() - t0, 1)
    report["architectures"] = list(llm.llm_engine.model_config.architectures)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=0, logprobs=0)
    out = llm.generate(["Describe the scene."], params)
    report["text_tokens"] = len(out[0].outputs[0].token_ids)
    try:
        image = Image.new("RGB", (64, 48), (120, 30, 200))
        out = llm.generate([{"prompt": "<image>\nHow many objects?", "multi_modal_data": {"image": image}}], params)
        report["image_prompt_tokens"] = len(out[0].prompt_token_ids or [])
        report["image_tokens"] = len(out[0].outputs[0].token_ids)
    except Exception as err:  # noqa: BLE001 - reported; the text check stands
        report["image_error"] = f"{type(err).__name__}: {err}"[:2000]
    print("OMNI_ENGINE", json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
