"""``policy.megatron_cfg.gpu_memory_fraction`` at a rank's set-up: ``init_distributed`` sets the cap before the
model is built (its own process: it makes a gloo group and Megatron's parallel state). The cap itself:
tests/unit/learner/test_memory_budget.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import json
from learner import model
from learner.config import MegatronConfig

seen = []
model.limit_gpu_memory = lambda megatron: seen.append(megatron.gpu_memory_fraction)
model.init_distributed(MegatronConfig(gpu_memory_fraction=0.3), seed=1)
print("RESULT " + json.dumps(seen))
model.shutdown_distributed()
"""


def test_init_distributed_applies_the_budget():
    """The rank's set-up (``Learner`` -> ``init_distributed``) is where the cap is set, before the model is built
    (own process: it makes a gloo group and Megatron's parallel state)."""
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")},
                               "PYTHONPATH": str(root), "RANK": "0", "WORLD_SIZE": "1"})
    # (not the parent's MASTER_PORT: an in-process learner of an earlier test may still listen on it)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    assert json.loads(lines[0][len("RESULT "):]) == [0.3]
