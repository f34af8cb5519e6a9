"""The repository's scripts (``scripts/``, ``bench/``) loaded as modules by the tests that check them."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str) -> ModuleType:
    """The script at ``ROOT / relative`` as the module ``name`` (registered in ``sys.modules``: dataclasses look
    their module up); its own directory is on ``sys.path`` while it loads, for a script that imports a sibling."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module
