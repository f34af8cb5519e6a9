"""Warm-start a tiny random Qwen2.5-VL on the answer format, as RL recipes start from an instruct model.

A random model almost never writes ``<think>...</think><answer>...</answer>``, so a format reward gives GRPO no
signal at all. This script fine-tunes it (transformers, CPU, a few seconds) on CLEVR-style prompts, built the
way the learner job builds them, whose targets are in the tagged format only ``--format-share`` of the time and
whose answers are *random words* from the data's answers: the model learns to sometimes use the format and learns
nothing about the right answer. GRPO then has both to raise (docs/multimodal.md, "The CPU recipe").

    .venv/bin/python scripts/warm_start_vlm.py --data data/clevr/train.jsonl --out models/tiny-vlm-warm

``--out`` gets the model, tokenizer, chat template and image processor, ready for ``policy.model_name``.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

THINK_WORDS = ["look", "count", "the", "shapes", "colors", "objects", "see", "one", "there"]


def target_text(rng: random.Random, answers: list[str], formatted: bool) -> str:
    answer = rng.choice(answers)
    if not formatted:
        return f"{rng.choice(THINK_WORDS)} {answer}"
    thought = " ".join(rng.choice(THINK_WORDS) for _ in range(rng.randint(1, 2)))
    return f"<think>{thought}</think><answer>{answer}</answer>"


def examples(model_dir: str, data: Path, limit: int):
    """(prompt ids, PreparedImage) of the first ``limit`` rows, through the job's own prompt path."""
    from transformers import AutoTokenizer

    from services.data.images import ImageRules, prepare_image
    from services.data.image_prompts import ImagePrompts, expand_image_tokens, image_token_id
    from services.data.prompt_template import PromptTemplate, read_template

    template = PromptTemplate(AutoTokenizer.from_pretrained(model_dir),
                              read_template(str(Path(__file__).resolve().parents[1] / "recipes/prompts/clevr_cot.txt")))
    rules, token = ImageRules.from_pretrained(model_dir), image_token_id(model_dir)
    rows = [json.loads(line) for line in data.read_text().splitlines()[:limit]]
    out, answers = [], sorted({str(r["output"]) for r in rows})
    for r in rows:
        image = prepare_image(r["image"], rules, base_dir=str(data.parent))
        turns = ImagePrompts.with_image_parts(template.messages(r["input"]), 1)
        out.append((expand_image_tokens(template.ids(turns=turns), [image], token), image))
    return out, answers, template.tokenizer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny://qwen2_5_vl", help="a model directory or tiny://qwen2_5_vl")
    ap.add_argument("--data", type=Path, required=True, help="a CLEVR-style JSONL (scripts/make_clevr.py)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--format-share", type=float, default=0.5, help="share of targets in the tagged format")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not 0.0 <= a.format_share <= 1.0:
        ap.error(f"--format-share: expected a share in [0, 1], got {a.format_share}")
    import torch
    from tqdm import tqdm
    from transformers import Qwen2_5_VLForConditionalGeneration

    from services.models.source import resolve_model

    model_dir = resolve_model(a.model)
    rng, torch_rng = random.Random(a.seed), torch.manual_seed(a.seed)
    data, answers, tokenizer = examples(model_dir, a.data, a.rows)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.train()
    bar = tqdm(range(a.steps), desc="warm start", unit="step")
    for _ in bar:
        loss = torch.zeros(())
        for prompt, image in rng.sample(data, a.batch):
            target = tokenizer(target_text(rng, answers, rng.random() < a.format_share))["input_ids"] + [end]
            ids = torch.tensor([prompt + target])
            labels = ids.clone()
            labels[0, :len(prompt)] = -100
            out = model(input_ids=ids, labels=labels, pixel_values=torch.from_numpy(np.asarray(image.pixel_values)),
                        image_grid_thw=torch.from_numpy(image.image_grid_thw[None]))
            loss = loss + out.loss / a.batch
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    del torch_rng
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out)
    for f in Path(model_dir).iterdir():  # tokenizer, chat template, image processor
        if f.is_file() and not f.name.startswith("model") and f.name != "config.json":
            shutil.copy2(f, a.out / f.name)
    print(f"wrote the warm-started model to {a.out} ({a.steps} steps, format share {a.format_share})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
