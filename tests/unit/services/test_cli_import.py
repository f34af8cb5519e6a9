"""Importing ``services.cli`` (the ``inflight`` script's module) stays light: processes started with ``spawn`` import
the main script again, and the image pool starts eight of them (services/data/image_pool.py). With the pool's stack
imported at the top, each worker imported torch, Ray and Ray Serve (~3 s of CPU) and the seed's learner took 43 s
to start on 2 cores instead of 9.5 s."""
from __future__ import annotations

from import_probe import imported_after

HEAVY = ("torch", "ray", "ray.serve", "fastapi", "vllm", "megatron", "transformers")


def test_importing_the_cli_module_imports_no_heavy_library():
    assert imported_after("import services.cli", HEAVY) == []


def test_the_recipe_model_imports_no_torch():
    assert imported_after("import services.recipe.config", ["torch"]) == []
