"""``inflight make-tiny-model``: write a random-init Hugging Face model and its local tokenizer (no hub).

Text families come from :mod:`services.models.tiny_model`, Qwen2.5-VL from :mod:`services.models.tiny_vlm`,
Nemotron-3-Nano-Omni from :mod:`services.models.tiny_omni`. A size or option the family does not offer is a usage
error naming what it offers (exit 2).
"""
from __future__ import annotations

import argparse


def add_command(sub) -> None:
    """Register ``make-tiny-model`` on the ``inflight`` parser's subcommands."""
    from services.models.tiny_model import ARCHS, SIZES
    from services.models.tiny_omni import ARCH as OMNI_ARCH
    from services.models.tiny_vlm import ARCH as VLM_ARCH
    from services.models.tiny_vlm import VLM_SIZES

    t = sub.add_parser("make-tiny-model", help="write a random-init HF model + local tokenizer")
    t.add_argument("dir")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--arch", choices=(*ARCHS, VLM_ARCH, OMNI_ARCH), default="qwen2",
                   help="model family (llama: Llama 2 layout, llama3: with Llama 3.x RoPE scaling; "
                        f"{VLM_ARCH}: Qwen2.5-VL, a vision tower + language model with an image processor; "
                        f"{OMNI_ARCH}: Nemotron-3-Nano-Omni's RADIO tower + Nemotron-H, no audio tower)")
    t.add_argument("--tie-word-embeddings", action="store_true",
                   help="share the embedding with the output layer (as Qwen2.5-0.5B/1.5B)")
    t.add_argument("--size", choices=tuple(dict.fromkeys((*SIZES, *VLM_SIZES))), default="tiny",
                   help=f"model size ({VLM_ARCH}: {', '.join(VLM_SIZES)})")
    t.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    t.add_argument("--max-positions", type=int, default=2048, metavar="N",
                   help="the context the model's config.json allows (max_position_embeddings; default 2048)")
    t.set_defaults(func=make_tiny_model_command, parser=t)


def make_tiny_model_command(args: argparse.Namespace) -> int:
    from services.models.tiny_model import make_tiny_model
    from services.models.tiny_omni import ARCH as OMNI_ARCH
    from services.models.tiny_omni import OMNI_SIZES, make_tiny_omni
    from services.models.tiny_vlm import ARCH as VLM_ARCH
    from services.models.tiny_vlm import VLM_SIZES, make_tiny_vlm

    if args.max_positions < 16:
        args.parser.error(f"--max-positions: expected >= 16, got {args.max_positions}")
    common = dict(seed=args.seed, dtype=args.dtype, max_positions=args.max_positions)
    for arch, sizes, make, what in ((OMNI_ARCH, OMNI_SIZES, make_tiny_omni, "RADIO vision tower + Nemotron-H, no "
                                                                             "audio tower"),
                                    (VLM_ARCH, VLM_SIZES, make_tiny_vlm, "vision tower + language model")):
        if args.arch != arch:
            continue
        if args.size not in sizes or args.tie_word_embeddings:
            args.parser.error(f"--arch {arch}: --size must be one of {tuple(sizes)} (got {args.size!r}) and "
                              "--tie-word-embeddings is not offered")
        out = make(args.dir, size=args.size, **common)
        print(f"wrote {arch}/{args.size} (seed {args.seed}; {what}) to {out}")
        return 0
    out = make_tiny_model(args.dir, arch=args.arch, size=args.size, tie_word_embeddings=args.tie_word_embeddings,
                          **common)
    tied = ", tied embeddings" if args.tie_word_embeddings else ""
    print(f"wrote {args.arch}/{args.size} (seed {args.seed}{tied}) to {out}")
    return 0
