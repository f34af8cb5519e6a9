"""torchvision without its compiled ops (rollout/torchvision_ops.py): the import works through the venv's .pth hook,
the missing op schemas are declared only when the package's _C cannot load, and its ops still fail loudly.

Declaring the schemas twice in one process raises, and this process may already have imported torchvision, so
everything that declares runs in a fresh interpreter."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from rollout.torchvision_ops import MISSING_OP_SCHEMAS, _TorchvisionHook, install


def _python(code: str, *args: str, timeout: float = 120) -> dict:
    """Run ``code`` in a fresh interpreter of this venv; it prints one JSON object last."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torchvision_imports_in_this_venv_and_nms_fails_without_ops():
    got = _python("""
        import json
        import torch
        import torchvision, torchvision.transforms.v2.functional  # noqa: F401
        from torchvision.extension import _has_ops
        err = None
        try:
            torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
        except Exception as e:  # noqa: BLE001
            err = [type(e).__name__, str(e)]
        print(json.dumps({"has_ops": _has_ops(), "err": err,
                          "schemas": [str(s) for s in torch._C._jit_get_schemas_for_operator("torchvision::nms")]}))
    """)
    assert got["schemas"], "torchvision::nms has no schema after importing torchvision"
    if got["has_ops"]:
        pytest.skip("torchvision's compiled ops load here: nms works")
    assert got["err"] is not None and got["err"][0] == "RuntimeError", got
    assert "C++ ops" in got["err"][1]


_DECLARE = """
    import json, sys
    from pathlib import Path
    import torch
    from rollout.torchvision_ops import declare_missing_ops
    def schemas(name):
        return [str(s) for s in torch._C._jit_get_schemas_for_operator("torchvision::" + name)]
    before = {n: schemas(n) for n in ("nms", "qnms")}
    declared = declare_missing_ops(Path(sys.argv[1]))
    after = {n: schemas(n) for n in ("nms", "qnms")}
    again = None
    try:
        declare_missing_ops(Path(sys.argv[1]))
    except Exception as e:  # noqa: BLE001
        again = type(e).__name__
    print(json.dumps({"before": before, "declared": declared, "after": after, "again": again,
                      "has_nms": hasattr(torch.ops.torchvision, "nms"),
                      "torchvision_imported": "torchvision" in sys.modules}))
"""


@pytest.mark.parametrize("so", [None, b"\x7fELF garbage, not a shared library" * 4, b""])
def test_declare_missing_ops_for_a_package_without_a_loadable_c(tmp_path, so):
    if so is not None:
        (tmp_path / "_C.so").write_bytes(so)
    got = _python(_DECLARE, str(tmp_path))
    assert not got["torchvision_imported"]
    assert got["before"] == {"nms": [], "qnms": []}  # nothing declared until it is needed
    assert got["declared"] is True
    for name, schema in MISSING_OP_SCHEMAS.items():
        assert got["after"][name] == [f"torchvision::{schema}"]
    assert got["has_nms"]
    assert got["again"] is not None  # a second declaration in one process raises (install() runs it once)


def test_declare_missing_ops_leaves_a_loadable_library_alone(tmp_path):
    """A ``_C*.so`` that loads (any real shared library; torch's own C extension loads as a library) means the
    compiled ops are there: nothing is declared."""
    got = _python("""
        import json, shutil, sys, tempfile
        from pathlib import Path
        import torch
        import torch._C as C
        from rollout.torchvision_ops import declare_missing_ops
        pkg = Path(tempfile.mkdtemp())
        shutil.copy(C.__file__, pkg / "_C.so")
        declared = declare_missing_ops(pkg)
        print(json.dumps({"declared": declared,
                          "nms": [str(s) for s in torch._C._jit_get_schemas_for_operator("torchvision::nms")]}))
    """)
    assert got == {"declared": False, "nms": []}


def test_hook_declares_once_on_first_torchvision_import_and_removes_itself():
    got = _python("""
        import json, sys
        from rollout.torchvision_ops import _TorchvisionHook, install
        hooks = lambda: sum(isinstance(f, _TorchvisionHook) for f in sys.meta_path)
        n_start = hooks()   # the venv's .pth already installed it
        install()
        n_twice = hooks()
        import torch
        before = len(torch._C._jit_get_schemas_for_operator("torchvision::nms"))
        import torchvision  # noqa: F401
        after = len(torch._C._jit_get_schemas_for_operator("torchvision::nms"))
        n_after = hooks()
        install()
        print(json.dumps({"start": n_start, "twice": n_twice, "before": before, "after": after,
                          "after_import": n_after, "reinstalled": hooks()}))
    """)
    assert got["start"] == 1, "the venv's .pth (scripts/setup.sh) did not install the hook"
    assert got["twice"] == 1
    assert got["before"] == 0 and got["after"] == 1
    assert got["after_import"] == 0 and got["reinstalled"] == 0


def test_install_is_a_no_op_once_torchvision_is_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", sys.modules.get("torchvision", object()))
    before = list(sys.meta_path)
    install()
    assert sys.meta_path == before


def test_hook_ignores_other_modules():
    hook = _TorchvisionHook()
    assert hook.find_spec("torchvision_extra") is None
    assert hook.find_spec("numpy") is None
