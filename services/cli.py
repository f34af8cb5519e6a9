"""``inflight`` command line.

    inflight validate --recipe PATH [key=value ...]   print the resolved recipe
    inflight make-tiny-model DIR [--seed N] [--arch qwen2|llama|qwen3_moe] [--size tiny|small|0.6b]

User errors (bad recipe, bad arguments) print one line and exit 2; no traceback.
"""
from __future__ import annotations

import argparse
import sys

from services.config import RecipeError, load_recipe, recipe_to_yaml

EXIT_USER_ERROR = 2


def _cmd_validate(args) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    sys.stdout.write(recipe_to_yaml(recipe))
    return 0


def _cmd_make_tiny_model(args) -> int:
    from services.tiny_model import make_tiny_model

    out = make_tiny_model(args.dir, seed=args.seed, arch=args.arch, size=args.size, dtype=args.dtype)
    print(f"wrote {args.arch}/{args.size} (seed {args.seed}) to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from services.tiny_model import ARCHS, SIZES

    p = argparse.ArgumentParser(prog="inflight", description="Asynchronous GRPO: vLLM rollout pool + Megatron learner.")
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("validate", help="load a recipe, apply overrides, print the result")
    v.add_argument("--recipe", default=None, help="recipe YAML (default: recipes/tiny-cpu.yaml)")
    v.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.async_grpo.enabled=true")
    v.set_defaults(func=_cmd_validate)

    t = sub.add_parser("make-tiny-model", help="write a random-init HF model + local tokenizer")
    t.add_argument("dir")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--arch", choices=ARCHS, default="qwen2")
    t.add_argument("--size", choices=tuple(SIZES), default="tiny")
    t.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    t.set_defaults(func=_cmd_make_tiny_model)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except RecipeError as err:
        print(f"inflight: recipe error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
