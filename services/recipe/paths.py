"""Relative paths in a recipe, found from anywhere (docs/configuration.md, "Paths").

A relative path a recipe names (data files and globs, prompt files, the model and tokenizer directories,
``file.py:name`` reward functions, environments and agents, image roots) is read from the current directory when it is
there; otherwise from the directory of the recipe file named on the command line, then from each directory above
it up to the top of its project tree (:func:`services.recipe.guard.project_root`: the nearest directory above it
holding ``.git``, ``pyproject.toml`` or ``setup.py``), and the first place where it exists replaces it by its
absolute path. So a
README block that names ``recipes/clevr-tiny-cpu.yaml`` works from any directory. A path found nowhere is left as
written (the checks of what a recipe points to report it). :func:`resolve_paths` rewrites a recipe's plain data
and lists what it changed; :func:`locate` is the rule for one path.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.recipe.guard import project_root

PATH_KEYS = ("policy.model_name", "policy.tokenizer.name", "data.train_data_path", "data.val_data_path",
             "data.prompt_file", "data.system_prompt_file")
"""Keys whose value is a file, a directory or a glob."""
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class ResolvedPath:
    """A recipe path that was not found from the current directory and was found elsewhere."""

    key: str
    """The dotted key, e.g. ``data.prompt_file`` or ``env.clevr.reward_functions.0.name``."""
    given: str
    """The value as the recipe wrote it."""
    resolved: str
    """The value used instead (an absolute path, with ``:name`` kept for a code reference)."""

    def line(self) -> str:
        """One line for ``inflight validate``'s summary."""
        return f"path: {self.key}: {self.given} -> {self.resolved} (not found from the current directory)"


def search_dirs(recipe_file: Path) -> tuple[Path, ...]:
    """Where a relative path not found from the current directory is looked for: the recipe file's directory, then
    each directory above it up to its project tree's top (NeMo-RL's ``examples/configs/recipes/llm/x.yaml`` names
    ``examples/prompts/cot.txt`` from its repository's top)."""
    here = recipe_file.resolve().parent
    top = project_root(here)
    return (here,) if top == here else (here, *here.parents[:here.parents.index(top) + 1])


def _exists(path: str) -> bool:
    return bool(glob.glob(path)) if _GLOB_CHARS & set(path) else os.path.exists(path)


def locate(value: str, dirs: Sequence[Path]) -> str:
    """``value`` itself when it is absolute, not a local path (``tiny://``, ``hf://``), or exists from the current
    directory; else the absolute path under the first of ``dirs`` where it exists; else ``value`` unchanged."""
    if not value or "://" in value or os.path.isabs(value) or _exists(value):
        return value
    for d in dirs:
        candidate = str(d / value)
        if _exists(candidate):
            return candidate
    return value


def _code_ref(value: str, dirs: Sequence[Path]) -> str:
    """``file.py:name`` with its file located; a registered name or ``package.module:name`` unchanged."""
    where, colon, attr = value.rpartition(":")
    if not colon or not where.endswith(".py"):
        return value
    found = locate(where, dirs)
    return value if found == where else f"{found}:{attr}"


def _references(data: dict) -> Iterator[tuple[str, Any, Any, bool]]:
    """``(key, holder, index, is_code)`` of every path-valued entry of the recipe data ``data``: ``holder[index]``
    is the value (``holder`` a mapping or, for ``data.image_roots``, a list's items by position)."""
    for key in PATH_KEYS:
        *sections, leaf = key.split(".")
        holder: Any = data
        for section in sections:
            holder = holder.get(section) if isinstance(holder, dict) else None
        if isinstance(holder, dict) and isinstance(holder.get(leaf), str):
            yield key, holder, leaf, False
    section = data.get("data")
    roots = section.get("image_roots") if isinstance(section, dict) else None
    if isinstance(roots, list):
        yield from ((f"data.image_roots.{i}", roots, i, False) for i, v in enumerate(roots) if isinstance(v, str))
    env = data.get("env")
    if not isinstance(env, dict):
        return
    if isinstance(env.get("reward_fn"), str):
        yield "env.reward_fn", env, "reward_fn", True
    for name, sec in env.items():
        if not isinstance(sec, dict):
            continue
        if isinstance(sec.get("environment"), str):
            yield f"env.{name}.environment", sec, "environment", True
        if isinstance(sec.get("agent"), str) and not sec["agent"].startswith(("http://", "https://")):
            yield f"env.{name}.agent", sec, "agent", True
        for i, fn in enumerate(sec.get("reward_functions") or []):
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                yield f"env.{name}.reward_functions.{i}.name", fn, "name", True


def resolve_paths(data: dict, recipe_file: Path) -> list[ResolvedPath]:
    """Rewrite in place each relative path of the recipe data ``data`` (Inflight keys) that is not found from the
    current directory but is found from :func:`search_dirs` of ``recipe_file``; returns what changed."""
    dirs = search_dirs(recipe_file)
    changed: list[ResolvedPath] = []
    for key, holder, index, is_code in list(_references(data)):
        given = holder[index]
        found = _code_ref(given, dirs) if is_code else locate(given, dirs)
        if found != given:
            holder[index] = found
            changed.append(ResolvedPath(key, given, found))
    return changed
