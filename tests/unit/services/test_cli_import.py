"""Importing ``services.cli`` (the ``inflight`` script's module) stays light: processes started with ``spawn`` import
the main script again, and the image pool starts eight of them (services/data/image_pool.py). With the pool's stack
imported at the top, each worker imported torch, Ray and Ray Serve (~3 s of CPU) and the seed's learner took 43 s
to start on 2 cores instead of 9.5 s."""
from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "ray", "ray.serve", "fastapi", "vllm", "megatron", "transformers")


def test_importing_the_cli_module_imports_no_heavy_library():
    code = f"import json, sys; import services.cli; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_recipe_model_imports_no_torch():
    code = "import sys; import services.recipe.config; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"
