"""``inflight export`` and ``checkpointing.save_hf``: a trained learner's checkpoint, exported from its run
directory, loads in transformers and in vLLM with the learner's log-probs (fp32, CPU, 1e-4)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from safetensors.torch import load_file

from learner_batches import groups, hf_response_logprobs, load_hf, make_learner, sequences

ATOL = 1e-4


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory):
    """A run directory (recipe.yaml + step_000001 saved with save_hf) of one large-lr step on the tiny Qwen2, and
    the learner's log-probs of fixed sequences after it."""
    from services.recipe.config import load_recipe
    from services.offline.export import save_run_recipe
    from services.job.checkpoints import Checkpoints, JobState
    from services.job.prompt_book import BookState

    run_dir = tmp_path_factory.mktemp("export-run")
    recipe = load_recipe(None, [f"policy.model_name={tiny_model_dir}", "checkpointing.save_hf=true"])
    save_run_recipe(recipe, tiny_model_dir, run_dir)
    learner = make_learner(tiny_model_dir, lr=0.05)
    initial = learner.logprobs(*sequences(4, seed=5))
    learner.train_step(groups(learner))
    prompts, responses = sequences(4, seed=5)
    trained = learner.logprobs(prompts, responses)
    assert max(np.abs(a - b).max() for a, b in zip(initial, trained, strict=True)) > 1e-2  # the step moved the weights
    state = JobState(1, BookState({}, {}, [], [], {}), [])
    ckpt = Checkpoints(recipe.checkpointing, run_dir).save(learner, state)  # type: ignore[arg-type] - an in-process learner saves as rank 0 does
    learner.shutdown()
    return run_dir, ckpt, prompts, responses, np.concatenate(trained)


def test_exported_model_loads_in_transformers_and_vllm_with_the_learners_logprobs(trained_run, tmp_path):
    from rollout.config import GenerationConfig, VllmConfig
    from rollout.engine import RolloutEngine
    from rollout.rewards.registry import get_reward_fn
    from services.offline.export import export

    run_dir, ckpt, prompts, responses, expected = trained_run
    lines: list[str] = []
    out = export(run_dir, tmp_path / "hf", progress=lines.append)  # default: the latest checkpoint
    assert "step 1" in lines[0] and lines[-1].startswith("wrote")
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {f.name for f in out.iterdir()}
    exported, at_save = load_file(out / "model.safetensors"), load_file(ckpt / "hf" / "model.safetensors")
    assert exported.keys() == at_save.keys() and all((exported[k] == at_save[k]).all() for k in exported)

    hf = hf_response_logprobs(load_hf(str(out)), prompts, responses)
    np.testing.assert_allclose(np.concatenate(hf), expected, atol=ATOL, rtol=0)

    generation = GenerationConfig(max_new_tokens=4, request_timeout_s=120.0, max_retries=1,
                                  vllm_cfg=VllmConfig(enforce_eager=True, precision="float32", seed=0,
                                                      gpu_memory_utilization=0.5))
    engine = RolloutEngine(str(out), generation, 128, get_reward_fn("repeat_letter"), engine_id="export")

    async def score():
        await asyncio.wait_for(engine.start(), engine.start_timeout_s + 10)
        try:
            return await engine.logprobs_of([p.tolist() for p in prompts], [r.tolist() for r in responses])
        finally:
            await engine.shutdown()
    np.testing.assert_allclose(np.concatenate(asyncio.run(score())), expected, atol=ATOL, rtol=0)


def test_cli_export_names_the_available_steps(trained_run, tmp_path, capsys):
    from services.cli import main

    run_dir = trained_run[0]
    assert main(["export", "--run-dir", str(run_dir), "--step", "7", "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of step 7" in err and "available steps: 1" in err, err
    assert main(["export", "--run-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "hf")]) == 2
    assert "no run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["export", "--run-dir", str(tmp_path / "empty"), "--out", str(tmp_path / "hf")]) == 2
    assert "recipe.yaml" in capsys.readouterr().err


class Payload:
    """Runs its code when unpickled: ``exec`` touches the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def copied_run(trained_run, tmp_path):
    import shutil

    run_dir, ckpt = trained_run[0], trained_run[1]
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy, copy / ckpt.relative_to(run_dir)


def test_export_refuses_a_pickled_payload_in_a_rank_file_without_running_it(trained_run, tmp_path):
    """Issue 32.4: a ``rank_00000.pt`` replaced by a pickle with a ``__reduce__`` payload is refused, in one line
    naming the file, and the payload does not run (before: ``torch.load(weights_only=False)`` ran it)."""
    import torch

    from services.offline.export import ExportError, export

    run_dir, ckpt = copied_run(trained_run, tmp_path)
    marker = tmp_path / "ran"
    torch.save({"model": Payload(marker)}, ckpt / "rank_00000.pt")
    with pytest.raises(ExportError) as err:
        export(run_dir, tmp_path / "hf", progress=lambda line: None)
    assert not marker.exists()
    line = str(err.value)
    assert "\n" not in line and str(ckpt / "rank_00000.pt") in line and "pickled reference to exec" in line, line
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.*"))  # nothing half-written is left


def test_export_with_a_recipe_edited_to_another_model_is_one_line_naming_the_mismatch(trained_run, family_models,
                                                                                      tmp_path):
    """Issue 32.6: ``recipe.yaml`` edited to another architecture (Qwen3 for a Qwen2 run)."""
    from services.offline.export import ExportError, export

    run_dir, ckpt = copied_run(trained_run, tmp_path)
    recipe = run_dir / "recipe.yaml"
    original = trained_run[0].joinpath("recipe.yaml").read_text()
    model_line = next(line for line in original.splitlines() if line.strip().startswith("model_name:"))
    recipe.write_text(original.replace(model_line, model_line.split(":")[0] + f": {family_models('qwen3')}"))
    with pytest.raises(ExportError) as err:
        export(run_dir, tmp_path / "hf", progress=lambda line: None)
    line = str(err.value)
    assert "\n" not in line and str(ckpt) in line and "another model" in line, line
    assert "in the checkpoint" in line or "missing (first: " in line, line
