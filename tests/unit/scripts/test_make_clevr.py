"""The CLEVR-style generator (scripts/make_clevr.py): deterministic per seed, answers that follow from the scene,
drawn colours that are in the image, the CoGenT-style split, and rows that load through the ``data.*`` loader and
whose images prepare (paths in JSONL, bytes in Parquet, the same images either way)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from PIL import Image
from repo_scripts import load_script

from services.data.dataset import RowMapper, load_rows
from services.data.image_pool import ImagePool
from services.recipe.data import DataConfig


def _load():
    return load_script("scripts/make_clevr.py", "make_clevr")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _make(tmp_path: Path, name: str, *extra: str) -> Path:
    _load().main(["--out-dir", str(tmp_path / name), "--num-train", "120", "--num-val", "40", *extra])
    return tmp_path / name


def test_same_seed_same_files_other_seed_differs(tmp_path):
    a, b, c = _make(tmp_path, "a"), _make(tmp_path, "b"), _make(tmp_path, "c", "--seed", "1")
    assert (a / "train.jsonl").read_text() == (b / "train.jsonl").read_text() != (c / "train.jsonl").read_text()
    assert sorted(p.name for p in (a / "images").iterdir()) == sorted(p.name for p in (b / "images").iterdir())
    assert all((a / "images" / p.name).read_bytes() == p.read_bytes() for p in (b / "images").iterdir())
    assert len(_rows(a / "train.jsonl")) == 120 and len(_rows(a / "val_b.jsonl")) == 40


def _answer(question: str, objects: list[str]) -> str:
    """The answer to a generated question, worked out from the scene's object list."""
    objs = [o.split() for o in objects]  # [size, color, shape]
    if question == "How many objects are there?":
        return str(len(objs))
    if m := re.fullmatch(r"How many (\w+)s are there\?", question):
        return str(sum(o[2] == m[1] for o in objs))
    if m := re.fullmatch(r"How many (\w+) objects are there\?", question):
        return str(sum(o[1] == m[1] for o in objs))
    if m := re.fullmatch(r"What color is the (\w+) (\w+)\?", question):
        (color,) = {o[1] for o in objs if (o[0], o[2]) == (m[1], m[2])}
        return color
    if m := re.fullmatch(r"What shape is the (\w+) object\?", question):
        (shape,) = {o[2] for o in objs if o[1] == m[1]}
        return shape
    m = re.fullmatch(r"Is there a (\w+) (\w+)\?", question)
    assert m, question
    return "yes" if any((o[1], o[2]) == (m[1], m[2]) for o in objs) else "no"


def test_answers_follow_from_the_scene_and_its_colours_are_drawn(tmp_path):
    gen = _load()
    out = _make(tmp_path, "a")
    rows = _rows(out / "train.jsonl")
    assert {r["question_type"] for r in rows} == {"count_all", "count_shape", "count_color", "query_color",
                                                  "query_shape", "exists"}
    assert 0.25 < np.mean([r["output"] == "yes" for r in rows if r["question_type"] == "exists"]) < 0.75
    for r in rows:
        assert r["output"] == _answer(r["input"], r["objects"]), r
    for r in {r["image"]: r for r in rows}.values():
        img = Image.open(out / r["image"])
        assert img.size == (r["width"], r["height"]) and img.mode == "RGB"
        rgb = np.asarray(img).astype(np.int32)
        drawn = set(np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2]).tolist())
        colours = [gen.COLORS[o.split()[1]] for o in r["objects"]]
        assert {red << 16 | green << 8 | blue for red, green, blue in colours} <= drawn
    sizes = {(r["width"], r["height"]) for r in rows}
    assert len(sizes) > 30 and len({w / h for w, h in sizes}) > 30  # heterogeneous shapes


def test_cogent_split_keeps_some_colour_shape_pairs_for_validation(tmp_path):
    out = _make(tmp_path, "a")
    pairs = {name: {tuple(o.split()[1:]) for r in _rows(out / f"{name}.jsonl") for o in r["objects"]}
             for name in ("train", "val_a", "val_b")}
    held_out = pairs["val_b"] - pairs["train"]
    assert held_out and all(shape in ("square", "triangle") for _, shape in held_out)
    assert pairs["val_a"] <= pairs["train"] | {(c, "circle") for c in _load().COLORS}
    assert {r["condition"] for r in _rows(out / "val_b.jsonl")} == {"B"}


def _processor_dir(tmp_path: Path) -> str:
    from transformers import Qwen2VLImageProcessorPil
    Qwen2VLImageProcessorPil(min_pixels=4 * 784, max_pixels=16 * 784).save_pretrained(str(tmp_path / "proc"))
    return str(tmp_path / "proc")


def test_rows_load_through_the_data_loader_and_their_images_prepare(tmp_path):
    files, as_bytes = _make(tmp_path, "files"), _make(tmp_path, "bytes", "--images", "bytes")
    proc = _processor_dir(tmp_path)
    hashes = {}
    for name, path, columns in (("files", files / "train.jsonl", None),
                                ("bytes", as_bytes / "train.parquet", ["question_type", "condition"])):
        data = DataConfig(train_data_path=str(path), image_key="image", image_workers=2, task_columns=columns)
        rows = load_rows(str(path))
        mapper = RowMapper.of(data)
        mapper.check_columns(rows, "data.train_data_path")
        mapped = [mapper.map(rows.row(i)) for i in range(len(rows))]
        assert [m.task["answer"] for m in mapped] == [r["output"] for r in _rows(files / "train.jsonl")]
        assert mapped[0].text == _rows(files / "train.jsonl")[0]["input"]
        refs = [ref for i in range(len(rows)) for ref in data.row_images(rows.row(i))]
        assert len(refs) == len(rows)
        with ImagePool.for_data(data, proc) as pool:
            prepared = pool.prepare(refs, base_dir=str(path.parent))
            assert pool.counts.prepared == len(rows) and not pool.counts.failed
            assert pool.counts.deduplicated >= len(rows) // 2 - 1  # two questions per scene
        hashes[name] = [p.sha256 for p in prepared]  # type: ignore[union-attr]
        assert len({tuple(p.image_grid_thw) for p in prepared}) > 5  # type: ignore[union-attr]
    hub = _make(tmp_path, "hub", "--images", "hub")  # NeMo-RL's CLEVR-CoGenT columns, save_to_disk per split
    assert sorted(p.name for p in hub.iterdir()) == ["train", "valA", "valB"]
    data = DataConfig(train_data_path=str(hub / "train"), image_key="image", input_key="problem",
                      output_key="solution", task_columns=[], image_workers=2)
    rows = load_rows(str(hub / "train"))
    assert rows.dataset.column_names == ["image", "problem", "solution"]
    mapper = RowMapper.of(data)
    mapper.check_columns(rows, "data.train_data_path")
    mapped = [mapper.map(rows.row(i)) for i in range(len(rows))]
    assert [m.task["answer"] for m in mapped] == [f"<answer> {r['output']} </answer>"
                                                  for r in _rows(files / "train.jsonl")]
    with ImagePool.for_data(data, proc) as pool:
        prepared = pool.prepare([ref for i in range(len(rows)) for ref in data.row_images(rows.row(i))],
                                base_dir=str(hub / "train"))
    assert [p.sha256 for p in prepared] == hashes["files"]  # type: ignore[union-attr]
    assert hashes["files"] == hashes["bytes"]  # the same PNG bytes, by path or inline
    assert DataConfig().row_images({"image": "x.png"}) == []  # no image_key: text rows
    assert DataConfig(image_key="img").row_images({"img": ["a.png", "b.png"]}) == ["a.png", "b.png"]
