"""``inflight export``'s checks before it builds anything (services/offline/export_checks.py, issue 32.6): a non-empty
``--out`` is refused unless ``--overwrite`` (which then replaces it whole, no stale files), a file or an unwritable
``--out`` is one line, and a ``recipe.yaml`` edited to another TP size is one line naming both values. Run through
the CLI as a user calls it; no learner is built (the model does not exist: every refusal comes before it)."""
from __future__ import annotations

import json
import os

import pytest

from services.cli import main
from services.offline.export_checks import ExportError, check_out, install_out, staging_dir

MODEL = "/nonexistent/model"


@pytest.fixture
def run_dir(tmp_path):
    """A run directory: recipe.yaml and a complete one-rank checkpoint (step 2, TP 1) named by ``latest``."""
    from services.recipe.config import load_recipe
    from services.offline.export import save_run_recipe

    run = tmp_path / "run"
    save_run_recipe(load_recipe(None, [f"policy.model_name={MODEL}"]), MODEL, run)
    ckpt = run / "results" / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 2, "policy_version": 2, "world_size": 1, "tp": 1, "ep": 1}))
    (ckpt / "rank_00000.pt").write_bytes(b"")
    (ckpt.parent / "latest").write_text(ckpt.name)
    return run


def export_line(capsys, run, out, *extra: str) -> str:
    assert main(["export", "--run-dir", str(run), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_a_non_empty_out_is_refused_without_overwrite(run_dir, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_text("another model's shard")
    line = export_line(capsys, run_dir, out)
    assert line == (f"inflight: --out {out} is not empty (1 entries: model-00001-of-00002.safetensors): pass "
                    "--overwrite to replace it, or choose a new directory")
    assert (out / "model-00001-of-00002.safetensors").exists()
    # with --overwrite the checks pass: the next refusal is the (missing) model, and --out is untouched
    assert "/nonexistent/model" in export_line(capsys, run_dir, out, "--overwrite")
    assert [p.name for p in out.iterdir()] == ["model-00001-of-00002.safetensors"]


def test_out_that_is_a_file_or_under_a_file_is_one_line(run_dir, tmp_path, capsys):
    f = tmp_path / "weights.bin"
    f.write_text("x")
    assert export_line(capsys, run_dir, f) == (f"inflight: --out {f} is a file; expected a directory (new, empty, "
                                               "or an old export with --overwrite)")
    assert export_line(capsys, run_dir, f / "hf") == f"inflight: --out {f / 'hf'} cannot be written: {f} is not a " \
                                                     "directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_out_or_parent_is_one_line(run_dir, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert export_line(capsys, run_dir, ro) == f"inflight: --out {ro} is not writable"
        assert export_line(capsys, run_dir, ro / "hf") == f"inflight: --out {ro / 'hf'} cannot be written: {ro} " \
                                                          "is not writable"
    finally:
        ro.chmod(0o755)


def test_a_recipe_edited_to_another_tp_size_is_one_line_naming_both(run_dir, capsys, tmp_path):
    recipe = run_dir / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("tensor_model_parallel_size: 1", "tensor_model_parallel_size: 2"))
    line = export_line(capsys, run_dir, tmp_path / "hf")
    assert line == (f"inflight: {recipe}: policy.megatron_cfg.tensor_model_parallel_size is 2, but checkpoint "
                    f"{run_dir / 'results' / 'checkpoints' / 'step_000002'} was saved with 1 (world size 1): restore "
                    "the run's recipe")


def test_overwrite_replaces_the_old_export_whole_and_never_the_run_directory(run_dir, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.safetensors").write_text("old")
    check_out(out, overwrite=True, run_dir=run_dir)
    tmp = staging_dir(out)
    (tmp / "config.json").write_text("{}")
    install_out(tmp, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"] and not tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # nothing left beside it
    with pytest.raises(ExportError, match="holds the run directory"):
        check_out(tmp_path, overwrite=True, run_dir=run_dir)
    with pytest.raises(ExportError, match="holds the run directory"):
        check_out(run_dir, overwrite=True, run_dir=run_dir)
