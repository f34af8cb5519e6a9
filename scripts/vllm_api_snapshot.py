"""Write the public names of a vLLM wheel's ``AsyncLLM`` (methods, properties, attributes set in ``__init__``) as
JSON, for ``tests/unit/rollout/test_vllm_api.py``: the engine calls on ``AsyncLLM`` must exist in every vLLM
Inflight runs on, and the GPU hosts' vLLM 0.25.1 cannot be imported here.

    python scripts/vllm_api_snapshot.py vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl \
        > tests/data/vllm_0.25.1_async_llm.json
"""
from __future__ import annotations

import ast
import json
import sys
import zipfile

SOURCE = "vllm/v1/engine/async_llm.py"


def async_llm_names(source: str) -> list[str]:
    """The public names ``AsyncLLM`` defines in ``source``: its methods and properties, and the attributes its
    ``__init__`` sets on ``self``."""
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "AsyncLLM")
    names = {f.name for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
    init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    for node in ast.walk(init):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        names |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                  and t.value.id == "self"}
    return sorted(n for n in names if not n.startswith("_"))


def main() -> None:
    with zipfile.ZipFile(sys.argv[1]) as wheel:
        version = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")).split("-")[1].split(".dist")[0]
        names = async_llm_names(wheel.read(SOURCE).decode())
    json.dump({"vllm": version, "class": "vllm.v1.engine.async_llm.AsyncLLM", "names": names}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
