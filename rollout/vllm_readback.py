"""The ``policy.generation.vllm_kwargs`` a started engine really runs with, read back from vLLM's own ``VllmConfig``.

vLLM files each engine argument under one of its config objects (``scheduler_config.max_num_seqs``,
``cache_config.mamba_ssm_cache_dtype``, ``model_config.multimodal_config.limit_per_prompt``...), and may change a
value it was given (a bound, a platform default). :func:`read_back` finds each merged ``vllm_kwargs`` entry there and
says whether it holds; the engine logs one line per entry at start and a warning for one that does not
(docs/rollout.md, "vLLM arguments the NeMo-RL way").
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RENAMED = {"limit_mm_per_prompt": "limit_per_prompt"}
"""Engine arguments vLLM files under another name."""
NESTED = ("model_config.multimodal_config",)
"""Config objects below ``VllmConfig``'s own fields that also hold engine arguments."""


@dataclass(frozen=True)
class ReadBack:
    """One ``vllm_kwargs`` entry against the started engine's config."""

    path: str
    """The entry's path inside ``vllm_kwargs`` (``max_num_seqs``, ``kernel_config.moe_backend``)."""
    asked: Any
    """The value the engine was started with."""
    where: str | None
    """Where vLLM keeps it (``scheduler_config.max_num_seqs``); None when no config object has the field."""
    found: Any = None
    """The value there."""

    @property
    def holds(self) -> bool:
        """Whether vLLM runs with the asked value (every asked key of a mapping; enums by value)."""
        if self.where is None:
            return False
        if isinstance(self.asked, Mapping):
            return isinstance(self.found, Mapping) and all(
                _plain(self.found.get(k)) == _plain(v) for k, v in self.asked.items())
        return _plain(self.found) == _plain(self.asked)

    def line(self) -> str:
        """``vllm_kwargs.max_num_seqs=128 read back from scheduler_config.max_num_seqs``, or what differs."""
        head = f"vllm_kwargs.{self.path}={self.asked!r}"
        if self.where is None:
            return f"{head}: no field of vLLM's config holds it (not read back)"
        if self.holds:
            return f"{head} read back from {self.where}"
        return f"{head} but the engine runs with {self.where}={_plain(self.found)!r}"


def read_back(vllm_config: Any, asked: Mapping[str, Any]) -> list[ReadBack]:
    """Each entry of ``asked`` (engine argument -> value; a config-class argument such as ``kernel_config`` as a
    mapping of its fields) looked up in ``vllm_config``."""
    found: list[ReadBack] = []
    for name, value in asked.items():
        owner = getattr(vllm_config, name, None)
        if isinstance(value, Mapping) and owner is not None and dataclasses.is_dataclass(owner):
            found += [_field(f"{name}.{k}", v, [(name, owner)], k) for k, v in value.items()]
        else:
            found.append(_field(name, value, _configs(vllm_config), RENAMED.get(name, name)))
    return found


def _configs(vllm_config: Any) -> list[tuple[str, Any]]:
    """``(path, object)`` of every config object of ``vllm_config`` that may hold an engine argument."""
    objects = [(f.name, getattr(vllm_config, f.name, None)) for f in dataclasses.fields(vllm_config)]
    for path in NESTED:
        head, _, tail = path.partition(".")
        objects.append((path, getattr(getattr(vllm_config, head, None), tail, None)))
    return [(p, o) for p, o in objects if o is not None and dataclasses.is_dataclass(o)]


def _field(path: str, asked: Any, owners: list[tuple[str, Any]], attr: str) -> ReadBack:
    for where, owner in owners:
        if attr in {f.name for f in dataclasses.fields(owner)}:
            return ReadBack(path, asked, f"{where}.{attr}", getattr(owner, attr))
    return ReadBack(path, asked, None)


def _plain(value: Any) -> Any:
    """An enum as its value; vLLM's per-modality dummy options (``ImageDummyOptions(count=2)``, which a
    ``limit_mm_per_prompt`` count becomes) as their count; a mapping's values likewise; other values unchanged."""
    if isinstance(value, enum.Enum):
        return value.value if not isinstance(value.value, enum.Enum) else value.name
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if type(value).__name__.endswith("DummyOptions") and isinstance(getattr(value, "count", None), int):
        return value.count
    return value
