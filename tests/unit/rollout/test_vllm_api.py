"""What the engine calls on vLLM's ``AsyncLLM`` exists in vLLM 0.25.1 too (the GPU hosts' version, which cannot be
imported here): its public names are in ``tests/data/vllm_0.25.1_async_llm.json``, read from the wheel by
``scripts/vllm_api_snapshot.py``. On 2026-12-05 ``RolloutEngine.counters`` called
``AsyncLLM.get_num_unfinished_requests`` (0.32 only): on the GPU every engine stats call raised, the pool's watcher
marked its one engine down seconds after "ready", and no GPU loop made a step."""
from __future__ import annotations

import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SNAPSHOT = json.loads((ROOT / "tests/data/vllm_0.25.1_async_llm.json").read_text())
GUARDED = {"update_weight_version": "rollout/labels.py calls it only where engine_labels_available() (false on "
                                    "0.25.1, which has no per-token weight versions)"}
"""Names 0.25.1 lacks that the code calls only behind a check of the installed vLLM."""
HANDLES = {"llm", "_llm"}
"""How the code names an ``AsyncLLM``: a local ``llm``, or an object's ``.llm`` / ``._llm``."""


def async_llm_uses() -> dict[str, set[str]]:
    """Attribute name -> the files reading it off an ``AsyncLLM`` handle, in ``rollout/`` and ``services/``."""
    uses: dict[str, set[str]] = {}
    for path in [*ROOT.glob("rollout/**/*.py"), *ROOT.glob("services/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in HANDLES) or (
                    isinstance(owner, ast.Attribute) and owner.attr in HANDLES):
                uses.setdefault(node.attr, set()).add(str(path.relative_to(ROOT)))
    return uses


def test_the_snapshot_is_vllm_0_25_1s_async_llm():
    assert SNAPSHOT["vllm"] == "0.25.1" and SNAPSHOT["class"] == "vllm.v1.engine.async_llm.AsyncLLM"
    assert {"generate", "abort", "collective_rpc", "pause_generation", "output_processor"} <= set(SNAPSHOT["names"])


def test_every_async_llm_name_the_engine_uses_exists_in_vllm_0_25_1():
    uses = async_llm_uses()
    assert {"generate", "collective_rpc", "abort"} <= set(uses), uses  # the scan sees the engine's calls
    missing = {name: sorted(files) for name, files in uses.items()
               if name not in SNAPSHOT["names"] and name not in GUARDED}
    assert not missing, f"not on vLLM 0.25.1's AsyncLLM (the GPU hosts'): {missing}"
