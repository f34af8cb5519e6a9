"""The bounds a recipe file is read within (docs/security.md, "Recipes").

A recipe names code (reward functions, environment classes) and is trusted like a script; these bounds keep a
recipe from reading what it does not name as a recipe and from making the loader hang or run out of memory:

- a recipe file (and every ``defaults:`` file) is a regular file of at most :data:`MAX_RECIPE_BYTES`, read without
  blocking (a FIFO or a device is refused, not opened for reading), UTF-8;
- its YAML expands to at most :data:`MAX_YAML_NODES` nodes counting every alias use (an alias bomb is refused
  before it is expanded);
- a ``defaults:`` file is a ``.yaml`` / ``.yml`` file inside one of :func:`recipe_roots`;
- only :data:`RESOLVERS` may appear in ``${name:...}`` (OmegaConf's ``oc.env`` and the other ``oc.*`` are refused).

No error message quotes a file's content.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from services.recipe.regular_file import FileRefused, read_regular_file

MAX_RECIPE_BYTES = 1 << 20
"""Largest recipe file read (1 MiB; NeMo-RL's largest recipes are ~20 KiB)."""
MAX_YAML_NODES = 100_000
"""Most YAML nodes a recipe file may expand to, every alias use counted (NeMo-RL's recipes have ~1,000)."""
RESOLVERS = ("add", "mul", "div", "max")
"""The resolvers a recipe may use: NeMo-RL's (``register_omegaconf_resolvers``)."""
ROOTS_ENV = "INFLIGHT_RECIPE_ROOTS"
"""Environment variable: more directories (``os.pathsep``-separated) whose trees ``defaults:`` may name."""
PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py")
"""An ancestor holding one of these is the top of the recipe's project tree."""
BUNDLED_RECIPES = Path(__file__).resolve().parents[2] / "recipes"
"""Inflight's own recipes, which any recipe may inherit from."""
YAML_SUFFIXES = (".yaml", ".yml")
_RESOLVER_USE = re.compile(r"\$\{\s*([^\s{}:$'\"]*)\s*:")


class RecipeError(ValueError):
    """A recipe could not be loaded; ``path`` is the dotted key path."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}" if path else reason)


def read_bounded(path: Path, what: str = "recipe") -> str:
    """The UTF-8 text of the regular file ``path`` (at most :data:`MAX_RECIPE_BYTES`); a FIFO, a device, a
    directory, a larger file or undecodable bytes are a :class:`RecipeError` that quotes none of the content."""
    try:
        data = read_regular_file(path, MAX_RECIPE_BYTES)
    except FileRefused as refused:
        raise RecipeError("", f"{what} {path}: " + ("not a regular file" if refused.kind == "not_a_file"
                                                    else f"larger than {MAX_RECIPE_BYTES} bytes")) from None
    except OSError as exc:
        raise RecipeError("", f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError("", f"{what} {path}: not UTF-8 text (byte {exc.start})") from None


def yaml_reason(exc: yaml.YAMLError) -> str:
    """What is wrong and where (line, column), without the snippet of the file that PyYAML's message carries."""
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or type(exc).__name__
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else str(problem)


def check_expansion(text: str, where: Path) -> None:
    """Refuse YAML that expands to more than :data:`MAX_YAML_NODES` nodes (aliases counted at every use) or that
    holds a recursive alias, without expanding it (the composed node graph shares aliased nodes)."""
    from omegaconf._utils import get_yaml_loader

    try:
        root = yaml.compose(text, Loader=get_yaml_loader())
    except yaml.YAMLError as exc:
        raise RecipeError("", f"{where} is not valid YAML: {yaml_reason(exc)}") from None
    except RecursionError:
        raise RecipeError("", f"{where}: YAML nested too deeply") from None
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise RecipeError("", f"{where}: a YAML alias refers to itself")
        active.add(key)
        total = 1
        children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
        for child in children:
            total += size(child)
            if total > MAX_YAML_NODES:
                raise RecipeError("", f"{where}: YAML expands to more than {MAX_YAML_NODES} nodes (aliases "
                                      f"counted at every use)")
        active.discard(key)
        sizes[key] = total
        return total

    if root is not None:
        try:
            size(root)
        except RecursionError:
            raise RecipeError("", f"{where}: YAML nested too deeply") from None


def project_root(folder: Path) -> Path:
    """The nearest ancestor of ``folder`` (itself included) holding a :data:`PROJECT_MARKERS` entry; ``folder``
    when none does."""
    for d in (folder, *folder.parents):
        if any((d / m).exists() for m in PROJECT_MARKERS):
            return d
    return folder


def recipe_roots(top: Path) -> tuple[Path, ...]:
    """The trees a ``defaults:`` file may lie in, for the recipe file ``top`` named on the command line: its
    project tree (:func:`project_root` of its directory), Inflight's own ``recipes/`` and the directories in
    ``$INFLIGHT_RECIPE_ROOTS``."""
    extra = [Path(p).resolve() for p in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if p.strip()]
    return (project_root(top.resolve().parent), BUNDLED_RECIPES, *extra)


def check_defaults_file(path: Path, named_by: Path, roots: tuple[Path, ...]) -> None:
    """``path`` (resolved, symlinks followed) may be read as a ``defaults:`` file of ``named_by``: a YAML file
    inside one of ``roots``."""
    if path.suffix not in YAML_SUFFIXES:
        raise RecipeError("defaults", f"{named_by}: {path} is not a .yaml/.yml file")
    if not any(path.is_relative_to(r) for r in roots):
        raise RecipeError("defaults", f"{named_by}: {path} lies outside the recipe's tree "
                                      f"({', '.join(str(r) for r in roots)}); add its directory to ${ROOTS_ENV} "
                                      f"to allow it")


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}.{i}" if path else str(i))
    elif isinstance(value, str):
        yield path, value


def check_resolvers(data: Any) -> None:
    """Every ``${name:...}`` in the unresolved recipe ``data`` names one of :data:`RESOLVERS`; another one
    (``oc.env`` reads the environment, ``oc.decode`` parses text) is a :class:`RecipeError` naming it and the key.
    An escaped ``\\${...}`` is refused as well (recipes have no use for one)."""
    for path, text in _strings(data, ""):
        for name in _RESOLVER_USE.findall(text):
            if name not in RESOLVERS:
                raise RecipeError(path, f"resolver {name!r} is not allowed in a recipe (the resolvers are "
                                        f"{', '.join(RESOLVERS)}; environment variables and files are not read "
                                        f"into recipes)")
