"""Write arithmetic word problems with numeric answers as JSONL train and validation files.

Each row: ``input`` (the problem), ``output`` (the answer as a string), ``operation`` (add, subtract, multiply),
``difficulty`` (1: numbers up to 10, 2: up to 20, 3: up to 50; multiplication stays small) and ``template`` (which
story it uses). The problems are generated from this file's own templates; the same ``--seed`` writes the same
files. The validation rows are drawn from another random stream than the training rows.

    python scripts/make_math_problems.py --out-dir data/math --num-train 4000 --num-val 200 --seed 0
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
TEMPLATES = {"add": ADD, "subtract": SUBTRACT, "multiply": MULTIPLY}
MAX_NUMBER = {1: 10, 2: 20, 3: 50}
"""Largest operand of a difficulty (for add and subtract; multiply uses at most a third of it, at least 5)."""


def problem(rng: random.Random) -> dict:
    """One word problem row."""
    op = rng.choice(sorted(TEMPLATES))
    difficulty = rng.choice(sorted(MAX_NUMBER))
    top = MAX_NUMBER[difficulty] if op != "multiply" else max(5, MAX_NUMBER[difficulty] // 3)
    a, b = rng.randint(2, top), rng.randint(1, top)
    if op == "subtract" and b > a:
        a, b = b, a
    k = rng.randrange(len(TEMPLATES[op]))
    text = TEMPLATES[op][k].format(name=rng.choice(NAMES), a=a, b=b)
    answer = a + b if op == "add" else a - b if op == "subtract" else a * b
    return {"input": text, "output": str(answer), "operation": op, "difficulty": difficulty,
            "template": f"{op}-{k}"}


def write(path: Path, n: int, rng: random.Random) -> Path:
    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps(problem(rng)) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True, help="where train.jsonl and val.jsonl are written")
    ap.add_argument("--num-train", type=int, default=4000)
    ap.add_argument("--num-val", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.num_train < 1 or args.num_val < 1:
        ap.error("--num-train and --num-val must be >= 1")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    train = write(args.out_dir / "train.jsonl", args.num_train, random.Random(f"train:{args.seed}"))
    val = write(args.out_dir / "val.jsonl", args.num_val, random.Random(f"val:{args.seed}"))
    print(f"wrote {args.num_train} rows to {train} and {args.num_val} rows to {val}")


if __name__ == "__main__":
    main()
