"""Issue 36's seed: NeMo-RL's two 32-GPU Nemotron-3-Nano-Omni CLEVR recipes (sync colocated and async 1-off,
tests/data/nemo_rl/recipes/vlm, unmodified) through ``inflight validate``, with only ``policy.model_name`` moved to
a local tiny Nano-Omni and the data to a local CLEVR-CoGenT copy (scripts/make_clevr.py --images hub):
every key kept, mapped or ignored with a reason, none refused, and a short summary."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.recipe.config import is_recipe_key, load_recipe_with_report
from services.recipe.files import read_recipe
from services.recipe.nemo_rl.rules import translate
from services.recipe.nemo_rl.table import TABLE

ROOT = Path(__file__).resolve().parents[3]
NEMO = ROOT / "tests" / "data" / "nemo_rl"
VLM = NEMO / "recipes" / "vlm"
SYNC = VLM / "vlm_grpo-nemotron-omni-30ba3b-clevr-8n4g-megatron-tp1ep8.v1.yaml"
ASYNC = VLM / "vlm_grpo-nemotron-omni-30ba3b-clevr-8n4g-megatron-tp1ep8-async.v1.yaml"
CHAIN = [NEMO / "vlm_grpo_3B.yaml", NEMO / "vlm_grpo_3B_megatron.yaml",
         VLM / "vlm_grpo-nemotron-omni-30ba3b-clevr-1n8g-megatron-tp8ep8.v1.yaml", SYNC, ASYNC]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The tiny Nano-Omni (make-tiny-model --arch nemotron_h_omni --max-positions 16384)."""
    from services.models.tiny_omni import make_tiny_omni
    return str(make_tiny_omni(tmp_path_factory.mktemp("model") / "omni", max_positions=16384))


@pytest.fixture(scope="module")
def clevr(tmp_path_factory) -> Path:
    """A local CLEVR-CoGenT copy in NeMo-RL's columns: one save_to_disk directory per split."""
    out = tmp_path_factory.mktemp("clevr-cogent")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_clevr.py"), "--out-dir", str(out), "--images", "hub",
                    "--num-train", "8", "--num-val", "4"], check=True, capture_output=True, cwd=ROOT)
    return out


def overrides(model: str, clevr: Path) -> list[str]:
    return [f"policy.model_name={model}", f"data.train.data_path={clevr / 'train'}",
            f"data.validation.data_path={clevr / 'valA'}"]


@pytest.mark.parametrize("recipe", CHAIN, ids=lambda p: p.stem)
def test_every_key_of_the_chain_is_kept_mapped_or_ignored_with_a_reason(recipe: Path, model, clevr):
    _, report = translate(read_recipe(recipe, overrides(model, clevr)), TABLE, is_recipe_key, strict=False)
    n = report.counts()
    assert n["unknown"] == 0 and n["errors"] == 0, (report.unknown, [str(e) for e in report.errors])
    assert n["kept"] + n["mapped"] + n["ignored"] == n["leaves"]
    assert all(i.why for i in report.ignored)


@pytest.mark.parametrize("recipe", [SYNC, ASYNC], ids=["sync", "async"])
def test_the_seed_recipes_validate_with_exit_0(recipe: Path, model, clevr):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "services.cli", "validate", "--recipe", str(recipe),
                          *overrides(model, clevr)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    out = yaml.safe_load(run.stdout)
    p, d = out["policy"], out["data"]
    assert p["model_name"] == model
    assert p["tokenizer"]["chat_template_kwargs"] == {"enable_thinking": True, "truncate_history_thinking": False}
    assert p["generation"]["bad_words"] == ["<image>", "<img>", "</img>", "<so_embedding>", "<so_start>", "<so_end>"]
    kw = p["generation"]["vllm_kwargs"]
    assert kw["max_num_seqs"] == (128 if recipe == ASYNC else 64) and kw["max_num_batched_tokens"] == 32768
    assert kw["kernel_config"] == {"enable_flashinfer_autotune": True, "moe_backend": "flashinfer_cutlass"}
    assert kw["all2all_backend"] == "flashinfer_nvlink_one_sided" and kw["mamba_ssm_cache_dtype"] == "float32"
    assert (d["train_data_path"], d["val_data_path"]) == (str(clevr / "train"), str(clevr / "valA"))
    assert (d["input_key"], d["output_key"], d["image_key"], d["env_name"]) == ("problem", "solution", "image",
                                                                                "clevr-cogent")
    assert d["prompt_file"].endswith("examples/prompts/clevr_cogent_cot_nemotron_omni.txt")
    rewards = out["env"]["clevr-cogent"]["reward_functions"]
    assert [(f["name"], f["weight"]) for f in rewards] == [("tag_format", 0.2), ("exact_alnum", 0.8)]
    assert out["grpo"]["async_grpo"]["enabled"] is (recipe == ASYNC)
    recipe_obj, _ = load_recipe_with_report(recipe, overrides(model, clevr))
    assert recipe_obj.model_dump(mode="json") == out
    # the summary: one header, sections with counts, each reason once on one line naming at most 3 keys
    ignored = [line for line in run.stderr.splitlines() if line.startswith("  ignored: ")]
    reasons = [line.split(": ", 2)[2] for line in ignored]
    assert run.stderr.count("have no meaning here") == 1 and len(reasons) == len(set(reasons)) < 100
    assert all(line.split(": ", 2)[1].count(", ") <= 2 for line in ignored)
    assert re.search(r"^policy: \d+ ignored$", run.stderr, re.M)
    # GPU-only vLLM arguments are named as ignored on CPU, once each
    for arg in ("all2all_backend", "kernel_config.moe_backend", "kernel_config.enable_flashinfer_autotune"):
        assert len(re.findall(rf"vllm_kwargs\.{re.escape(arg)}=.* ignored on cpu", run.stderr)) == 1, arg


@pytest.mark.parametrize("recipe", [SYNC, ASYNC], ids=["sync", "async"])
def test_without_a_local_copy_the_data_is_clevr_cogent_on_the_hub(recipe: Path, model):
    recipe_obj, _ = load_recipe_with_report(recipe, [f"policy.model_name={model}"])
    d = recipe_obj.data
    assert (d.train_data_path, d.train_split) == ("hf://MMInstruction/Clevr_CoGenT_TrainA_70K_Complex", "train")
    assert (d.val_data_path, d.val_split) == ("hf://MMInstruction/Clevr_CoGenT_ValA", "train")


def test_the_readme_section_runs_these_recipes_with_these_overrides_only():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index("## The seed's recipes"):], re.S)
    assert block, "README.md: no bash block under ## The seed's recipes"
    runs = [line.split() for line in block.group(1).splitlines() if " validate " in line]
    assert [Path(r[r.index("--recipe") + 1]).name for r in runs] == [SYNC.name, ASYNC.name]
    for r in runs:
        assert sorted(a.split("=")[0] for a in r[r.index("--recipe") + 2:]) == \
            ["data.train.data_path", "data.validation.data_path", "policy.model_name"]


def test_docs_say_what_inflight_does_with_every_key_of_both_recipes(model, clevr):
    text = (ROOT / "docs" / "nemo_rl.md").read_text()
    section = text[text.index("## The seed's recipes, key by key"):text.index("## Porting a recipe")]
    for recipe in (SYNC, ASYNC):
        _, report = translate(read_recipe(recipe, [f"policy.model_name={model}"]), TABLE, is_recipe_key, strict=False)
        keys = {*report.kept, *(m.source for m in report.mapped), *(i.source for i in report.ignored)}
        missing = sorted(k for k in keys if f"`{k}`" not in section)
        assert not missing, f"docs/nemo_rl.md does not list {missing}"
