"""Write arithmetic word problems with numeric answers as JSONL train and validation files.

Each row: ``input`` (the problem), ``output`` (the answer as a string), ``operation`` (count, add, subtract,
multiply), ``difficulty`` (0: one-digit answers, counting included -- what the tiny CPU model can learn; 1: numbers
up to 10, 2: up to 20, 3: up to 50; multiplication stays small) and ``template`` (which story it uses);
``--max-difficulty`` caps the difficulty (drawn uniformly from 0 or 1 up to it). The problems are generated from this file's own templates; the same ``--seed`` writes the same
files. The validation rows are drawn from another random stream than the training rows.

    python scripts/make_math_problems.py --out-dir data/math --num-train 4000 --num-val 200 --seed 0
    python scripts/make_math_problems.py --out-dir data/math-easy --max-difficulty 0   # recipes/math-jsonl-cpu.yaml
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam")
ADD = (
    "{name} has {a} apples and picks {b} more. How many apples does {name} have now?",
    "A train carries {a} passengers. At the next station {b} more get on. How many passengers are on the train?",
    "A notebook costs {a} dollars and a pen costs {b} dollars. How many dollars do both cost together?",
    "{name} read {a} pages on Monday and {b} pages on Tuesday. How many pages did {name} read in all?",
    "A farm has {a} cows and {b} sheep. How many animals does the farm have?",
)
SUBTRACT = (
    "{name} has {a} marbles and gives {b} of them to a friend. How many marbles does {name} have left?",
    "A train carries {a} passengers. At the next station {b} get off. How many passengers are still on the train?",
    "{name} has {a} dollars and buys a book for {b} dollars. How many dollars does {name} have left?",
    "A bakery made {a} muffins and sold {b}. How many muffins are left?",
    "A tank holds {a} liters of water and {b} liters leak out. How many liters are left?",
)
MULTIPLY = (
    "{name} buys {a} bags with {b} oranges in each bag. How many oranges does {name} buy?",
    "A train has {a} cars and each car has {b} windows. How many windows does the train have?",
    "One ticket costs {b} dollars. How many dollars do {a} tickets cost?",
    "A box holds {a} rows of {b} eggs. How many eggs are in the box?",
    "{name} walks {b} kilometers every day for {a} days. How many kilometers does {name} walk?",
)
COUNT = (
    "{name} has {a} apples. How many apples does {name} have?",
    "A box holds {a} eggs. How many eggs are in the box?",
    "{name} sees {a} birds on a fence. How many birds does {name} see?",
)
TEMPLATES = {"add": ADD, "subtract": SUBTRACT, "multiply": MULTIPLY}
MAX_NUMBER = {1: 10, 2: 20, 3: 50}
"""Largest operand of a difficulty (for add and subtract; multiply uses at most a third of it, at least 5)."""


def easy_problem(rng: random.Random) -> dict:
    """A difficulty-0 row: counting (the answer is in the text) or adding/subtracting to a one-digit answer."""
    op = rng.choice(("count", "add", "subtract"))
    a = rng.randint(1, 9)
    b = 0 if op == "count" else rng.randint(0, 9 - a) if op == "add" else rng.randint(0, a)
    stories = COUNT if op == "count" else TEMPLATES[op]
    k = rng.randrange(len(stories))
    answer = a if op == "count" else a + b if op == "add" else a - b
    return {"input": stories[k].format(name=rng.choice(NAMES), a=a, b=b), "output": str(answer), "operation": op,
            "difficulty": 0, "template": f"{op}-{k}"}


def problem(rng: random.Random, max_difficulty: int = 3) -> dict:
    """One word problem row, of a difficulty up to ``max_difficulty``."""
    if max_difficulty == 0:
        return easy_problem(rng)
    op = rng.choice(sorted(TEMPLATES))
    difficulty = rng.choice([d for d in sorted(MAX_NUMBER) if d <= max_difficulty])
    top = MAX_NUMBER[difficulty] if op != "multiply" else max(5, MAX_NUMBER[difficulty] // 3)
    a, b = rng.randint(2, top), rng.randint(1, top)
    if op == "subtract" and b > a:
        a, b = b, a
    k = rng.randrange(len(TEMPLATES[op]))
    text = TEMPLATES[op][k].format(name=rng.choice(NAMES), a=a, b=b)
    answer = a + b if op == "add" else a - b if op == "subtract" else a * b
    return {"input": text, "output": str(answer), "operation": op, "difficulty": difficulty,
            "template": f"{op}-{k}"}


def write(path: Path, n: int, rng: random.Random, max_difficulty: int = 3) -> Path:
    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps(problem(rng, max_difficulty)) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True, help="where train.jsonl and val.jsonl are written")
    ap.add_argument("--num-train", type=int, default=4000)
    ap.add_argument("--num-val", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-difficulty", type=int, default=3, choices=(0, 1, 2, 3),
                    help="0: one-digit answers only (the tiny CPU model's data)")
    args = ap.parse_args(argv)
    if args.num_train < 1 or args.num_val < 1:
        ap.error("--num-train and --num-val must be >= 1")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    d = args.max_difficulty
    train = write(args.out_dir / "train.jsonl", args.num_train, random.Random(f"train:{args.seed}"), d)
    val = write(args.out_dir / "val.jsonl", args.num_val, random.Random(f"val:{args.seed}"), d)
    print(f"wrote {args.num_train} rows to {train} and {args.num_val} rows to {val}")


if __name__ == "__main__":
    main()
