"""NeMo-RL's own GRPO recipes (tests/data/nemo_rl, unmodified) through ``inflight validate``, each with
``policy.model_name`` pointed at a local tiny model of its family. Every leaf key must be kept, mapped, ignored
with a reason or an error naming it; what still blocks a recipe is listed in ``BLOCKERS`` (docs/nemo_rl.md)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from services.recipe.config import is_recipe_key, load_recipe_with_report
from services.recipe.nemo_rl.rules import translate
from services.recipe.nemo_rl.table import TABLE
from services.recipe.files import read_recipe

ROOT = Path(__file__).resolve().parents[3]
NEMO = ROOT / "tests" / "data" / "nemo_rl"


@dataclass(frozen=True)
class Fixture:
    file: str
    arch: str
    blockers: frozenset[str] = frozenset()
    """Keys Inflight cannot honour yet: each is a translation error naming it."""
    extra: tuple[str, ...] = ()
    """Overrides besides ``policy.model_name`` that pointing the recipe at another model needs."""

    @property
    def path(self) -> Path:
        return NEMO / self.file


FIXTURES = [
    Fixture("grpo_math_1B.yaml", "qwen2"),
    Fixture("grpo_math_1B_megatron.yaml", "qwen2"),
    Fixture("grpo_math_qwen30ba3b_megatron.yaml", "qwen3_moe"),
    Fixture("recipes/llm/dapo-qwen2.5-7b.v2.yaml", "qwen2"),
    # the recipe names its tokenizer apart from its model (both meta-llama/Llama-3.1-8B-Instruct): moving the model
    # to another directory moves the tokenizer only if told
    Fixture("recipes/llm/performance/grpo-llama3.1-8b-instruct-2n4g-async-1off.yaml", "llama3",
            extra=("policy.tokenizer.name=${policy.model_name}",
                   # its data.default.prompt_file comes from grpo_math_1B.yaml, three directories up: named here
                   f"data.default.prompt_file={NEMO / 'examples' / 'prompts' / 'cot.txt'}")),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """One tiny model per family (``inflight make-tiny-model``'s function); the qwen2 one has DAPO's context
    (``hf_config_overrides.max_position_embeddings: 16384`` is then the model's own value, as it must be here)."""
    from services.models.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    sizes = {"qwen2": 16384, "llama3": 2048, "qwen3_moe": 4096}
    return {arch: str(make_tiny_model(root / arch, arch=arch, max_positions=n)) for arch, n in sizes.items()}


def overrides(f: Fixture, models: dict[str, str], *more: str) -> list[str]:
    return [f"policy.model_name={models[f.arch]}", *f.extra, *more]


def validate(f: Fixture, models: dict[str, str], *more: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "services.cli", "validate", "--recipe", str(f.path),
                           *overrides(f, models, *more)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)


@pytest.mark.parametrize("f", FIXTURES, ids=lambda f: Path(f.file).stem)
def test_every_leaf_key_is_kept_mapped_ignored_or_an_error_naming_it(f: Fixture, models):
    data = read_recipe(f.path, overrides(f, models))
    _, report = translate(data, TABLE, is_recipe_key, strict=False)
    n = report.counts()
    assert n["unknown"] == 0, f"keys nobody maps: {report.unknown}"
    assert n["kept"] + n["mapped"] + n["ignored"] + n["errors"] == n["leaves"]
    assert all(i.why for i in report.ignored)
    assert {e.path for e in report.errors} == f.blockers


@pytest.mark.parametrize("f", FIXTURES, ids=lambda f: Path(f.file).stem)
def test_validate_exits_0_on_the_recipe_as_it_is(f: Fixture, models, tmp_path):
    """The acceptance test of issue 17: ``inflight validate`` on the unmodified recipe, its model moved."""
    run = validate(f, models)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("have no meaning here") == 1 and "ignored: policy.dtensor_cfg" in run.stderr
    written = yaml.safe_load(run.stdout)  # the run copy: Inflight keys only, and it loads as it is
    assert "dtensor_cfg" not in written["policy"]
    assert set(written["policy"]["tokenizer"]) == {"name", "chat_template_kwargs"}
    recipe, _ = load_recipe_with_report(f.path, overrides(f, models))
    assert recipe.model_dump(mode="json") == written
    copy = tmp_path / "recipe.yaml"  # what a run directory keeps, and export and a resume read back
    copy.write_text(run.stdout)
    again, report = load_recipe_with_report(copy)
    assert again == recipe and not report.ignored and not report.unknown


README_SECTION = "## Bring a NeMo-RL recipe and a model family"


def test_the_readme_block_runs_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(README_SECTION):], re.S)
    assert block, f"README.md: no bash block under {README_SECTION!r}"
    for name in (".venv", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for cmd in [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]:
        done = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{cmd!r} failed:\n{done.stderr[-3000:]}"
    assert "ignored: policy.dtensor_cfg" in done.stderr
    assert yaml.safe_load(done.stdout)["policy"]["model_name"] == "models/tiny-qwen2"
    assert (tmp_path / "models/tiny-qwen2/config.json").is_file()
