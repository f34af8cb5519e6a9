"""A data row's images in its prompt (services/data/image_prompts.py) and the image handling of the prompt source
(services/data/prompt_source.py) and the row mapping (services/data/dataset.py), on a tiny Qwen2.5-VL and CLEVR-style
rows drawn by scripts/make_clevr.py; images are prepared by a real one-worker image pool."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from protocol import PromptRequest, decode, encode
from services.data.images import ImageRules, prepare_image
from services.recipe.config import load_recipe
from services.data.dataset import RowMapper, load_rows
from services.data.image_prompts import IMAGE_PAD, BadImage, ImagePrompts, image_inputs, image_token_id, vision_token_ids
from services.data.prompt_source import DataExhausted, PromptSource, image_prompts, row_prompts, validation_prompts

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    from services.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), seed=0)


@pytest.fixture(scope="module")
def tok(vlm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(vlm_dir))


@pytest.fixture(scope="module")
def ids(tok) -> dict[str, int]:
    return {t: tok.convert_tokens_to_ids(t)
            for t in ("<|vision_start|>", "<|vision_end|>", IMAGE_PAD, "<|video_pad|>")}


@pytest.fixture(scope="module")
def clevr(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clevr")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_clevr.py"), "--out-dir", str(out), "--num-train",
                    "20", "--num-val", "4"], check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def rules(vlm_dir) -> ImageRules:
    return ImageRules.from_pretrained(vlm_dir)


@pytest.fixture
def make(vlm_dir, tok):
    """``make(path, *overrides) -> (recipe, RowPrompts)`` with images; every image pool made is closed after."""
    made: list[ImagePrompts] = []

    def build(path, *overrides: str):
        recipe = _recipe(path, *overrides)
        images = image_prompts(recipe, str(vlm_dir))
        assert images is not None
        made.append(images)
        return recipe, row_prompts(recipe, tok, str(path), "data.train_data_path", "row-", images=images)

    yield build
    for images in made:
        images.close()


def _recipe(path, *overrides: str):
    return load_recipe(None, ["data.dataset_name=null", f"data.train_data_path={path}", "data.image_key=image",
                              "data.image_workers=1", "data.input_key=input", "data.output_key=output",
                              *overrides])


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _runs(prompt_ids, ids) -> list[list[int]]:
    """The tokens between each vision_start and its vision_end."""
    seq = [int(t) for t in prompt_ids]
    starts = [k for k, t in enumerate(seq) if t == ids["<|vision_start|>"]]
    ends = [k for k, t in enumerate(seq) if t == ids["<|vision_end|>"]]
    assert len(starts) == len(ends)
    return [seq[s + 1:e] for s, e in zip(starts, ends, strict=True)]


# ----------------------------------------------------------------------------- one image per row (CLEVR)

def test_row_prompt_carries_its_image_and_its_expanded_tokens(make, clevr, ids, tok, rules, vlm_dir):
    _, rp = make(clevr / "train.jsonl")
    train = [json.loads(line) for line in (clevr / "train.jsonl").read_text().splitlines()]
    for i in (0, 1, 5):
        req = rp.get(i)
        want = prepare_image(train[i]["image"], rules, base_dir=str(clevr))
        assert not isinstance(want, Exception) and hasattr(want, "rgb"), want
        assert req.prompt_id == f"row-{i}"
        runs = _runs(req.prompt_ids, ids)
        assert runs == [[ids[IMAGE_PAD]] * want.num_tokens], (i, runs)
        assert int((req.prompt_ids == ids[IMAGE_PAD]).sum()) == want.num_tokens
        # the rest of the prompt is the template's rendering of an image part before the question's text
        turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": train[i]["input"]}]}]
        rendered = tok.apply_chat_template(turns, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert rp.images.expand(rendered, [want]) == req.prompt_ids.tolist()
        # the wire image is the prepared one: its resized pixels and its bytes' name
        assert len(req.images) == 1
        img = req.images[0]
        assert img.sha256 == want.sha256 == hashlib.sha256((clevr / train[i]["image"]).read_bytes()).hexdigest()
        assert img.pixels.dtype == np.uint8
        np.testing.assert_array_equal(img.pixels, want.rgb)
        # the learner's inputs made from the wire pixels are the processor's outputs, bit for bit
        got = image_inputs(req.images, ImageRules.from_pretrained(vlm_dir))
        assert got.pixel_values.dtype == want.pixel_values.dtype == np.float32
        np.testing.assert_array_equal(got.pixel_values, want.pixel_values)
        np.testing.assert_array_equal(got.image_grid_thw, want.image_grid_thw[None])
        # the image column is not task metadata; the answer and the other columns are
        assert "image" not in req.task and req.task["answer"] == train[i]["output"]
        assert req.task["question_type"] == train[i]["question_type"]


def test_prompt_survives_the_wire(make, clevr):
    _, rp = make(clevr / "train.jsonl")
    req = rp.get(2)
    back = decode(encode(req), PromptRequest)
    np.testing.assert_array_equal(back.prompt_ids, req.prompt_ids)
    assert back.images[0].sha256 == req.images[0].sha256
    np.testing.assert_array_equal(back.images[0].pixels, req.images[0].pixels)


def test_several_images_of_a_row_expand_each_to_its_own_count(make, clevr, ids, rules):
    names = sorted(p.name for p in (clevr / "images").glob("train_*.png"))
    prepared = {n: prepare_image(f"images/{n}", rules, base_dir=str(clevr)) for n in names}
    counts = {n: p.num_tokens for n, p in prepared.items()}
    a = names[0]
    b = next((n for n in names if counts[n] != counts[a]), None)
    if b is None:
        pytest.skip("every CLEVR image here has the same token count")
    path = _write(clevr / "two.jsonl", [{"input": "Same objects?", "output": "no",
                                         "image": [f"images/{a}", f"images/{b}", f"images/{a}"]}])
    _, rp = make(path)
    req = rp.get(0)
    assert _runs(req.prompt_ids, ids) == [[ids[IMAGE_PAD]] * counts[n] for n in (a, b, a)]
    assert [i.sha256 for i in req.images] == [prepared[n].sha256 for n in (a, b, a)]
    for img, n in zip(req.images, (a, b, a), strict=True):
        np.testing.assert_array_equal(img.pixels, prepared[n].rgb)
    got = image_inputs(req.images, rules)
    np.testing.assert_array_equal(got.pixel_values, np.concatenate([prepared[n].pixel_values for n in (a, b, a)]))
    np.testing.assert_array_equal(got.image_grid_thw, np.stack([prepared[n].image_grid_thw for n in (a, b, a)]))
    # the image parts precede the text in the user turn
    seq = req.prompt_ids.tolist()
    assert seq.index(ids["<|vision_start|>"]) < len(seq) - seq[::-1].index(ids["<|vision_end|>"]) - 1


def test_base_dir_is_the_data_files_directory(clevr, tmp_path):
    rows = load_rows(str(clevr / "train.jsonl"), cache_dir=str(tmp_path / "cache"))
    assert rows.base_dir(0) == str(clevr) and rows.base_dir(len(rows) - 1) == str(clevr)


def test_row_mapper_leaves_the_image_column_out_of_the_task(tmp_path):
    row = {"input": "q", "output": "a", "image": "x.png", "condition": "A"}
    recipe = _recipe(tmp_path / "r.jsonl")
    mapper = RowMapper.of(recipe.data)
    assert mapper.image_key == "image"
    assert mapper.map(row).task == {"condition": "A", "answer": "a"}
    listed = RowMapper("input", "output", "messages", ("image", "condition"), "image")
    assert listed.map(row).task == {"condition": "A", "answer": "a"}
    assert RowMapper("input", "output", "messages").map(row).task["image"] == "x.png"  # text data keep it


# ----------------------------------------------------------------------------- bad images

def _bad_data(clevr: Path, where: Path) -> Path:
    """Rows: a missing file, the good image, a truncated PNG, text named .png, an empty file, no image."""
    (where / "images").mkdir()
    png = (clevr / "images" / "train_000000.png").read_bytes()
    shutil.copy(clevr / "images" / "train_000000.png", where / "images" / "good.png")
    (where / "images" / "truncated.png").write_bytes(png[:len(png) // 2])
    (where / "images" / "text.png").write_bytes(b"this is not an image at all")
    (where / "images" / "empty.png").write_bytes(b"")
    images = ["images/absent.png", "images/good.png", "images/truncated.png", "images/text.png",
              "images/empty.png", None]
    return _write(where / "bad.jsonl", [{"input": f"How many objects? ({k})", "output": "3", "image": img}
                                        for k, img in enumerate(images)])


BAD_KINDS = {"data_image_failures_empty": 1, "data_image_failures_missing": 2,
             "data_image_failures_not_an_image": 1, "data_image_failures_truncated": 1}


def test_rows_with_bad_images_are_skipped_and_counted_by_kind(make, clevr, tmp_path):
    _, rp = make(_bad_data(clevr, tmp_path))
    for i in (0, 2, 3, 4, 5):
        with pytest.raises(BadImage):
            rp.get(i)
    assert rp.get(1).images[0].sha256 == hashlib.sha256((tmp_path / "images" / "good.png").read_bytes()).hexdigest()


def test_prompt_source_skips_bad_images_and_keeps_the_count_across_a_resume(make, clevr, tmp_path):
    _, rp = make(_bad_data(clevr, tmp_path))
    src = PromptSource(rp, seed=0, shuffle=False)
    assert src.counts() == {"data_epoch": 0, "data_dropped_too_long": 0, "data_skipped_invalid": 0,
                            "data_image_failures": 0}
    got = src.next(1, 1)
    assert [p.prompt_id for p in got] == ["row-1@0"] and got[0].scheduled_step == 1 and len(got[0].images) == 1
    assert src.counts() == {"data_epoch": 0, "data_dropped_too_long": 0, "data_skipped_invalid": 0,
                            "data_image_failures": 1, "data_image_failures_missing": 1}
    got = src.next(1, 2)  # the rest of epoch 0 and the first row of epoch 1 fail
    assert [p.prompt_id for p in got] == ["row-1@1"]
    assert src.counts() == {"data_epoch": 1, "data_dropped_too_long": 0, "data_skipped_invalid": 0,
                            "data_image_failures": 6, **{**BAD_KINDS, "data_image_failures_missing": 3}}
    pos = src.position()
    assert sum(pos["failed_images"].values()) == 6 and pos["failed_images"]["missing"] == 3
    _, rp2 = make(tmp_path / "bad.jsonl")
    resumed = PromptSource(rp2, seed=0, shuffle=False)
    resumed.seek(pos)
    assert resumed.failed_images == src.failed_images and resumed.counts()["data_image_failures"] == 6
    assert resumed.position() == pos
    assert [p.prompt_id for p in resumed.next(1, 3)] == [p.prompt_id for p in src.next(1, 3)] == ["row-1@2"]
    old = dict(pos)
    del old["failed_images"]  # a checkpoint of a run before images
    resumed.seek(old)
    assert not resumed.failed_images


def test_first_prompts_skip_bad_images_without_counting_them(make, clevr, tmp_path):
    _, rp = make(_bad_data(clevr, tmp_path))
    src = PromptSource(rp, seed=0, shuffle=False)
    first = src.first_prompts(3)
    assert [p.prompt_id for p in first] == ["row-1"] and len(first[0].images) == 1
    assert not src.failed_images and src.counts()["data_image_failures"] == 0


def _kinds(counts: dict) -> int:
    return sum(v for k, v in counts.items() if k.startswith("data_image_failures_"))


def test_first_prompts_add_no_per_kind_counts(make, clevr, tmp_path):
    _, rp = make(_bad_data(clevr, tmp_path))
    src = PromptSource(rp, seed=0, shuffle=False)
    src.first_prompts(3)
    assert _kinds(src.counts()) == src.counts()["data_image_failures"] == 0, src.counts()


def test_a_rolled_back_draw_keeps_no_per_kind_counts(make, clevr, tmp_path):
    _, rp = make(_bad_data(clevr, tmp_path))
    src = PromptSource(rp, seed=0, shuffle=False, max_epochs=1)
    src.next(1, 1)  # row 0 fails, row 1 is drawn
    with pytest.raises(DataExhausted):
        src.next(1, 2)  # rows 2..5 fail, then the epoch ends: nothing is drawn and the position is restored
    assert sum(src.failed_images.values()) == 1
    assert _kinds(src.counts()) == src.counts()["data_image_failures"], src.counts()


def test_a_source_of_only_bad_images_is_an_error_and_draws_nothing(make, clevr, tmp_path):
    path = _bad_data(clevr, tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    _, rp = make(_write(tmp_path / "all_bad.jsonl", [r for k, r in enumerate(rows) if k != 1]))
    src = PromptSource(rp, seed=0, shuffle=False)
    before = src.position()
    with pytest.raises(ValueError, match="none of the 5 rows is usable"):
        src.next(1, 1)
    assert src.position() == before and not src.failed_images


def test_validation_prompts_skip_bad_images(clevr, tmp_path, tok, vlm_dir):
    path = _bad_data(clevr, tmp_path)
    recipe = _recipe(path, f"data.val_data_path={path}", "grpo.max_val_samples=2")
    got = validation_prompts(recipe, str(vlm_dir), tokenizer=tok)
    assert [p.prompt_id for p in got] == ["val:row-1"] and len(got[0].images) == 1


def test_text_data_have_no_image_prompts(vlm_dir, tmp_path):
    recipe = load_recipe(None, ["data.dataset_name=null", f"data.train_data_path={tmp_path / 'r.jsonl'}"])
    assert image_prompts(recipe, str(vlm_dir)) is None


# ----------------------------------------------------------------------------- the pieces, without a pool

def _pieces(token: int = 7) -> ImagePrompts:
    return ImagePrompts(pool=None, refs_of=lambda row: [], token_id=token)  # type: ignore[arg-type]


class _Img:
    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens


def test_expand_repeats_each_placeholder_to_its_images_count():
    ip = _pieces(7)
    assert ip.expand([1, 7, 2, 7, 3], [_Img(3), _Img(1)]) == [1, 7, 7, 7, 2, 7, 3]
    assert ip.expand([7], [_Img(4)]) == [7, 7, 7, 7]
    assert ip.expand([1, 2], []) == [1, 2]


@pytest.mark.parametrize("seq,n", [([1, 7, 7, 2], 1), ([1, 2], 1), ([7], 2), ([7], 0)])
def test_expand_with_the_wrong_number_of_placeholders_names_the_counts(seq, n):
    placeholders = seq.count(7)
    with pytest.raises(ValueError, match=f"rendered {placeholders} <\\|image_pad\\|> for {n} images"):
        _pieces(7).expand(seq, [_Img(2)] * n)


def test_with_image_parts_puts_the_images_before_the_first_user_turns_text():
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is it?"},
             {"role": "assistant", "content": "a cube"}, {"role": "user", "content": "and its colour?"}]
    out = ImagePrompts.with_image_parts(turns, 2)
    assert out[1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what is it?"}]
    assert out[0] == turns[0] and out[2:] == turns[2:]
    assert turns[1]["content"] == "what is it?"  # the input is not changed
    assert ImagePrompts.with_image_parts([{"role": "user", "content": "hi"}], 1)[0]["content"] == [
        {"type": "image"}, {"type": "text", "text": "hi"}]
    with pytest.raises(ValueError, match="no user turn"):
        ImagePrompts.with_image_parts([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], 1)
    with pytest.raises(ValueError, match="no user turn"):
        ImagePrompts.with_image_parts([], 1)


def test_prepare_of_a_row_without_images_is_a_missing_image():
    ip = _pieces()
    with pytest.raises(BadImage) as err:
        ip.prepare({"input": "q"}, None)
    assert err.value.kind == "missing"


def test_vision_token_ids_and_image_token_id(vlm_dir, ids, tmp_path):
    assert vision_token_ids(str(vlm_dir)) == frozenset(ids.values()) and len(ids) == 4
    assert image_token_id(str(vlm_dir)) == ids[IMAGE_PAD]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ValueError, match="no integer image_token_id"):
        image_token_id(str(tmp_path))
    assert vision_token_ids(str(tmp_path)) == frozenset()
