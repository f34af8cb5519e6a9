"""What a fresh interpreter has imported after one statement: the tests that keep a module light (the CLI script,
the recipe model, the pool's face) run it in a subprocess, since the test process has imported everything."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence


def imported_after(statement: str, modules: Sequence[str]) -> list[str]:
    """Those of ``modules`` in ``sys.modules`` of a new Python process once ``statement`` has run, in their order."""
    code = f"import json, sys; {statement}; print(json.dumps([m for m in {tuple(modules)!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
