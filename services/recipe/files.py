"""Reading a recipe file into plain data: composition, overrides, interpolation.

Every recipe — Inflight's own and NeMo-RL's — is read the way NeMo-RL reads its
configs (``nemo_rl/utils/config.py``), with OmegaConf:

1. ``defaults: base.yaml`` (or a list of files), relative to the file that names it, is read first and
   recursively; the file's keys are merged over it (mappings key by key, anything else replaced). A mapping that
   holds ``_override_: true`` replaces the inherited one instead of merging into it. A cycle is an error; a
   ``defaults:`` file must be a YAML file inside the recipe's tree (:func:`services.recipe.guard.recipe_roots`).
2. Command-line overrides ``key.path=value`` (value parsed as YAML; Hydra's ``+``/``++`` prefixes accepted,
   ``~key.path`` deletes) apply to the composed recipe *before* interpolation is resolved, so overriding
   ``policy.max_total_sequence_length`` moves every value interpolated from it.
3. ``${a.b}`` interpolations and NeMo-RL's resolvers ``${add:x,y}``, ``${mul:x,y}``, ``${div:x,y}``,
   ``${max:x,y}`` are resolved to plain dicts and lists; any other resolver (``oc.env``...) is an error.

Every file is read within :mod:`services.recipe.guard`'s bounds (regular file, size, alias expansion).

A file that cannot be read, bad YAML, a ``???`` (mandatory) value left unset, or an interpolation that does not
resolve is a :class:`RecipeError` naming the key.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from services.recipe.guard import (
    RecipeError,
    check_defaults_file,
    check_expansion,
    check_resolvers,
    read_bounded,
    recipe_roots,
    yaml_reason,
)

OVERRIDE_MARKER = "_override_"
"""NeMo-RL's marker: a mapping holding ``_override_: true`` replaces the inherited mapping instead of merging."""


def register_resolvers() -> None:
    """NeMo-RL's resolvers (``register_omegaconf_resolvers``), registered once per process."""
    for name, fn in (("add", lambda a, b: a + b), ("mul", lambda a, b: a * b), ("div", lambda a, b: a / b),
                     ("max", lambda a, b: max(a, b))):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def _omega_error(exc: OmegaConfBaseException, what: str) -> RecipeError:
    key = str(getattr(exc, "full_key", "") or "")
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return RecipeError(key, f"{what}: {msg}")


def _load_file(path: Path) -> DictConfig:
    text = read_bounded(path)
    check_expansion(text, path)
    try:
        cfg = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as exc:
        raise RecipeError("", f"{path} is not valid YAML: {yaml_reason(exc)}") from None
    except OmegaConfBaseException as exc:
        raise _omega_error(exc, f"{path} cannot be read as a recipe") from None
    if not isinstance(cfg, DictConfig):
        raise RecipeError("", f"{path}: expected a mapping at the top level, got {type(cfg).__name__}")
    return cfg


def _strip_override_markers(over: DictConfig, base: DictConfig | None) -> None:
    """Drop from ``base`` every mapping that ``over`` marks ``_override_: true`` (at any depth; NeMo-RL looks at the
    top level only), and drop the markers."""
    for key in list(over.keys()):
        node = over._get_node(key)
        if not isinstance(node, DictConfig) or node._is_missing() or node._is_none() or node._is_interpolation():
            continue
        below = base._get_node(key) if base is not None and key in base else None
        if node.get(OVERRIDE_MARKER, False) is True:
            node.pop(OVERRIDE_MARKER)
            if base is not None and key in base:
                base.pop(key)
            below = None
        _strip_override_markers(node, below if isinstance(below, DictConfig) else None)


def merge(base: DictConfig, over: DictConfig, where: str = "") -> DictConfig:
    """``over`` merged into ``base`` (NeMo-RL's ``merge_with_override``)."""
    _strip_override_markers(over, base)
    try:
        out = OmegaConf.merge(base, over)
    except OmegaConfBaseException as exc:
        raise _omega_error(exc, f"cannot merge {where or 'recipe'} over its defaults") from None
    assert isinstance(out, DictConfig)
    return out


def compose(path: Path, seen: tuple[Path, ...] = (), roots: tuple[Path, ...] | None = None) -> DictConfig:
    """The recipe at ``path`` merged over its ``defaults`` chain; interpolations left unresolved. ``roots``: the
    trees ``defaults:`` files may lie in (default: :func:`~services.recipe.guard.recipe_roots` of ``path``)."""
    roots = recipe_roots(path) if roots is None else roots
    path = path.resolve()
    if path in seen:
        raise RecipeError("defaults", f"cycle: {' -> '.join(str(p) for p in seen + (path,))}")
    cfg = _load_file(path)
    if "defaults" not in cfg:
        _strip_override_markers(cfg, None)
        return cfg
    defaults = cfg.pop("defaults")
    names = [defaults] if isinstance(defaults, str) else list(defaults) if isinstance(defaults, ListConfig) else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise RecipeError("defaults", f"{path}: expected a file name or a list of them, got {defaults!r}")
    base = OmegaConf.create({})
    for name in names:
        parent = (Path(name) if name.startswith("/") else path.parent / name).resolve()
        check_defaults_file(parent, path, roots)
        base = merge(base, compose(parent, seen + (path,), roots), str(parent))
    return merge(base, cfg, str(path))


def parse_override(text: str) -> tuple[list[str], Any, bool]:
    """``key.path=value`` -> (key parts, value, delete). Hydra's ``+``/``++`` prefixes are accepted; ``~key``
    deletes the key."""
    delete = text.startswith("~")
    body = text[1:] if delete else text.lstrip("+")
    if "=" not in body and not delete:
        raise RecipeError(text, "an override must look like key.path=value")
    key, raw = body.split("=", 1) if "=" in body else (body, "")
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(key, "empty key segment in override")
    try:
        holder = OmegaConf.load(io.StringIO(f"v: {raw}")) if raw.strip() else None
        # unresolved: an interpolation in an override is resolved with the recipe's, after check_resolvers
        plain = OmegaConf.to_container(holder, resolve=False) if isinstance(holder, DictConfig) else None
        value = plain["v"] if isinstance(plain, dict) else raw.strip()
    except (yaml.YAMLError, OmegaConfBaseException):
        value = raw
    return parts, value, delete


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Set each ``key.path=value`` in ``cfg`` (creating mappings on the way; a ``null`` on the way becomes one)."""
    for text in overrides:
        parts, value, delete = parse_override(text)
        node = cfg
        for i, p in enumerate(parts[:-1]):
            here = ".".join(parts[:i + 1])
            child = node._get_node(p) if p in node else None
            if child is None or (not isinstance(child, DictConfig) and child._is_none()):
                node[p] = {}
            elif not isinstance(child, DictConfig):
                raise RecipeError(here, f"is a value ({child._value()!r}), cannot set a key under it")
            node = node[p]
        if delete:
            if parts[-1] not in node:
                raise RecipeError(".".join(parts), "cannot delete: no such key")
            node.pop(parts[-1])
        else:
            try:
                node[parts[-1]] = value
            except OmegaConfBaseException as exc:
                raise _omega_error(exc, f"cannot set {'.'.join(parts)}") from None
    return cfg


def resolve(cfg: DictConfig) -> dict:
    """Plain data with every interpolation resolved; a ``???`` left or a bad interpolation names its key."""
    register_resolvers()
    check_resolvers(OmegaConf.to_container(cfg, resolve=False))
    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        missing = type(exc).__name__ == "MissingMandatoryValue"
        raise _omega_error(exc, "mandatory value (???) not set" if missing else "cannot resolve") from None
    assert isinstance(data, dict)
    return data


def read_recipe(path: Path, overrides: list[str] | None = None) -> dict:
    """Compose ``path``, apply ``overrides``, resolve: the recipe as plain data, before any key is checked."""
    return resolve(apply_overrides(compose(path), overrides or []))
