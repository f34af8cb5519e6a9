"""Write a CLEVR-style image question set: scenes drawn with Pillow, short-answer questions, a CoGenT-style split.

A scene is 1 to ``--max-objects`` shapes (square, circle, triangle) in 8 colours and 2 sizes, apart from each other,
on a plain background; each scene has its own image size (width and height drawn from 64 to 320 pixels, so a batch
holds many shapes of image and padding matters). Each scene gets ``--questions-per-image`` questions with one-word
answers: how many objects / squares / red objects are there, what colour is the large circle, what shape is the
green object (asked only when exactly one object fits), is there a blue triangle (yes / no).

The CoGenT-style split (CLEVR's Compositional Generalization Test): in condition A squares are gray, blue, brown
or yellow and triangles red, green, purple or cyan; condition B swaps the two colour sets; circles take any colour.
``train`` and ``val_a`` are condition A, ``val_b`` condition B, so B's square and triangle colours appear only in
validation.

Rows (``train.jsonl``, ``val_a.jsonl``, ``val_b.jsonl``): ``input`` (the question), ``output`` (the answer),
``image`` (the PNG's path relative to the JSONL file, under ``images/``), ``question_type``, ``condition``,
``width``, ``height`` and ``objects`` (the scene: ``"small red circle"``, ...). ``--images bytes`` writes Parquet
files instead (``train.parquet``, ...), whose ``image`` column holds the PNG bytes. The same ``--seed`` writes the
same files; every split has its own random stream. ``--images hub`` writes NeMo-RL's CLEVR-CoGenT layout instead
(the Hub sets ``MMInstruction/Clevr_CoGenT_*`` that its ``clevr-cogent`` dataset reads): one ``datasets``
``save_to_disk`` directory per split (``train``, ``valA``, ``valB``) with the columns ``image`` (a ``datasets.Image``),
``problem`` (the question) and ``solution`` (``<answer> ... </answer>``), a local copy for a NeMo-RL recipe's
``data.<train|validation>.data_path``.

    python scripts/make_clevr.py --out-dir data/clevr --num-train 2000 --num-val 100 --seed 0
    python scripts/make_clevr.py --out-dir data/clevr-bytes --images bytes
    python scripts/make_clevr.py --out-dir data/clevr-cogent --images hub
"""
from __future__ import annotations

import argparse
import io
import json
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

SHAPES = ("square", "circle", "triangle")
COLORS = {"gray": (128, 128, 128), "red": (200, 40, 40), "blue": (40, 70, 210), "green": (40, 160, 60),
          "brown": (130, 80, 40), "purple": (130, 50, 170), "cyan": (40, 190, 200), "yellow": (230, 200, 40)}
SIZES = {"small": 0.09, "large": 0.17}
"""Object radius as a share of the image's shorter side."""
BACKGROUND = (235, 235, 228)
SET_1, SET_2 = ("gray", "blue", "brown", "yellow"), ("red", "green", "purple", "cyan")
CONDITIONS = {"A": {"square": SET_1, "triangle": SET_2, "circle": tuple(COLORS)},
              "B": {"square": SET_2, "triangle": SET_1, "circle": tuple(COLORS)}}
"""Colours each shape may take in a condition (CLEVR-CoGenT's cube/cylinder colour swap; spheres any colour)."""
SPLITS = {"train": "A", "val_a": "A", "val_b": "B"}
MIN_SIDE, MAX_SIDE = 64, 320


@dataclass(frozen=True)
class Obj:
    """One object of a scene: its attributes and where it is drawn (centre, radius in pixels)."""

    shape: str
    color: str
    size: str
    x: int
    y: int
    r: int


def scene(rng: random.Random, condition: str, max_objects: int) -> tuple[int, int, list[Obj]]:
    """An image size and 1..max_objects objects that do not touch (placement by rejection)."""
    w, h = rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE)
    objs: list[Obj] = []
    for _ in range(rng.randint(1, max_objects)):
        shape = rng.choice(SHAPES)
        color, size = rng.choice(CONDITIONS[condition][shape]), rng.choice(tuple(SIZES))
        r = max(4, round(SIZES[size] * min(w, h)))
        for _try in range(50):
            x, y = rng.randint(r, w - r), rng.randint(r, h - r)
            if all((x - o.x) ** 2 + (y - o.y) ** 2 > (r + o.r + 2) ** 2 for o in objs):
                objs.append(Obj(shape, color, size, x, y, r))
                break
    return w, h, objs


def draw(w: int, h: int, objs: list[Obj]) -> bytes:
    """The scene as PNG bytes."""
    img = Image.new("RGB", (w, h), BACKGROUND)
    pen = ImageDraw.Draw(img)
    for o in objs:
        box = (o.x - o.r, o.y - o.r, o.x + o.r, o.y + o.r)
        fill = COLORS[o.color]
        if o.shape == "square":
            pen.rectangle(box, fill=fill)
        elif o.shape == "circle":
            pen.ellipse(box, fill=fill)
        else:
            pen.polygon([(o.x, o.y - o.r), (o.x - o.r, o.y + o.r), (o.x + o.r, o.y + o.r)], fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _plural(shape: str) -> str:
    return shape + "s"


def questions(rng: random.Random, objs: list[Obj], condition: str) -> list[tuple[str, str, str]]:
    """Every question this scene answers unambiguously, as ``(type, question, answer)``, in a shuffled order."""
    out = [("count_all", "How many objects are there?", str(len(objs)))]
    shape = rng.choice(SHAPES)
    out.append(("count_shape", f"How many {_plural(shape)} are there?", str(sum(o.shape == shape for o in objs))))
    color = rng.choice(tuple(COLORS))
    out.append(("count_color", f"How many {color} objects are there?", str(sum(o.color == color for o in objs))))
    for o in rng.sample(objs, len(objs)):
        if sum((p.size, p.shape) == (o.size, o.shape) for p in objs) == 1:
            out.append(("query_color", f"What color is the {o.size} {o.shape}?", o.color))
            break
    for o in rng.sample(objs, len(objs)):
        if sum(p.color == o.color for p in objs) == 1:
            out.append(("query_shape", f"What shape is the {o.color} object?", o.shape))
            break
    if rng.random() < 0.5:  # about half the answers are yes: ask about an object of the scene
        o = rng.choice(objs)
        ask_shape, ask_color = o.shape, o.color
    else:
        ask_shape = rng.choice(SHAPES)
        ask_color = rng.choice(CONDITIONS[condition][ask_shape])
    there = any((o.shape, o.color) == (ask_shape, ask_color) for o in objs)
    out.append(("exists", f"Is there a {ask_color} {ask_shape}?", "yes" if there else "no"))
    rng.shuffle(out)
    return out


def rows(split: str, n: int, seed: int, max_objects: int, per_image: int, image_dir: Path | None):
    """``n`` rows of ``split`` and, by image name, the PNG bytes of their scenes (written to ``image_dir``
    when given)."""
    rng, condition = random.Random(f"{split}:{seed}"), SPLITS[split]
    out, images, k = [], {}, 0
    while len(out) < n:
        w, h, objs = scene(rng, condition, max_objects)
        png, name = draw(w, h, objs), f"images/{split}_{k:06d}.png"
        k += 1
        images[name] = png
        if image_dir is not None:
            (image_dir / Path(name).name).write_bytes(png)
        for qtype, q, a in questions(rng, objs, condition)[:per_image]:
            out.append({"input": q, "output": a, "image": name, "question_type": qtype, "condition": condition,
                        "width": w, "height": h, "objects": [f"{o.size} {o.color} {o.shape}" for o in objs]})
    return out[:n], images


def write_split(out_dir: Path, split: str, n: int, seed: int, max_objects: int, per_image: int,
                as_bytes: bool) -> Path:
    """Write one split as JSONL + PNG files, or as Parquet with the PNG bytes inline."""
    image_dir = None if as_bytes else out_dir / "images"
    if image_dir is not None:
        image_dir.mkdir(parents=True, exist_ok=True)
    split_rows, images = rows(split, n, seed, max_objects, per_image, image_dir)
    if not as_bytes:
        path = out_dir / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in split_rows))
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    for r in split_rows:
        r["image"] = images[r["image"]]
    path = out_dir / f"{split}.parquet"
    pq.write_table(pa.Table.from_pylist(split_rows), path)
    return path


HUB_SPLITS = {"train": "train", "val_a": "valA", "val_b": "valB"}
"""This script's splits -> the split names of NeMo-RL's clevr-cogent dataset."""


def write_hub_split(out_dir: Path, split: str, n: int, seed: int, max_objects: int, per_image: int) -> Path:
    """Write one split as NeMo-RL's CLEVR-CoGenT Hub set: a ``save_to_disk`` directory (image, problem, solution)."""
    import datasets

    split_rows, images = rows(split, n, seed, max_objects, per_image, None)
    table = {"image": [{"bytes": images[r["image"]], "path": None} for r in split_rows],
             "problem": [r["input"] for r in split_rows],
             "solution": [f"<answer> {r['output']} </answer>" for r in split_rows]}
    features = datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"),
                                  "solution": datasets.Value("string")})
    path = out_dir / HUB_SPLITS[split]
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(path))
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True, help="where the splits (and images/) are written")
    ap.add_argument("--num-train", type=int, default=2000, help="training rows")
    ap.add_argument("--num-val", type=int, default=100, help="rows of each validation split (val_a, val_b)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-objects", type=int, default=6, help="objects per scene: 1 to this")
    ap.add_argument("--questions-per-image", type=int, default=2, help="rows that share one scene (1 to 5)")
    ap.add_argument("--images", choices=("files", "bytes", "hub"), default="files",
                    help="files: JSONL rows with relative PNG paths; bytes: Parquet rows with the PNG bytes; hub: "
                         "NeMo-RL's CLEVR-CoGenT columns, one save_to_disk directory per split")
    args = ap.parse_args(argv)
    if args.num_train < 1 or args.num_val < 1:
        ap.error("--num-train and --num-val must be >= 1")
    if not 1 <= args.max_objects <= 10:
        ap.error(f"--max-objects: expected 1 to 10, got {args.max_objects}")
    if not 1 <= args.questions_per_image <= 5:
        ap.error(f"--questions-per-image: expected 1 to 5, got {args.questions_per_image}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", args.num_train), ("val_a", args.num_val), ("val_b", args.num_val)):
        path = write_hub_split(args.out_dir, split, n, args.seed, args.max_objects, args.questions_per_image) \
            if args.images == "hub" else write_split(args.out_dir, split, n, args.seed, args.max_objects,
                                                     args.questions_per_image, args.images == "bytes")
        print(f"wrote {n} rows to {path} (condition {SPLITS[split]})")


if __name__ == "__main__":
    main()
