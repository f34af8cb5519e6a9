"""The rule kinds that say what one NeMo-RL recipe key means here, and the translator that applies a table of them.

A rule is found by the key's dotted path, exactly or by the longest ``prefix.*`` pattern. A key with no rule that
names an Inflight key passes through unchanged; any other key is left for the recipe schema, which rejects it as
unknown. The translator returns the Inflight recipe data and a :class:`TranslationReport` of what it kept, mapped
and ignored, so that nothing is dropped silently. Every recipe goes through it, Inflight's own included: a rule
on a path that is also an Inflight key must leave an Inflight recipe's value as it is (:class:`When` helps).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.recipe.paths import ResolvedPath

Path = str
"""A dotted key path, e.g. ``policy.megatron_cfg.scheduler.lr_warmup_iters``."""


class TranslationError(ValueError):
    """A NeMo-RL key whose value has no counterpart here; ``path`` is the NeMo-RL key."""

    def __init__(self, path: Path, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


@dataclass(frozen=True)
class Rename:
    """The key means the same as Inflight's ``target`` (its value, through ``convert`` when given)."""

    target: Path
    convert: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Ignore:
    """The key has no meaning here (another backend, a kernel or logging option): dropped, listed with ``why``."""

    why: str


@dataclass(frozen=True)
class NeutralOnly:
    """An algorithm setting Inflight does not implement: accepted (and listed as ignored) only at one of its
    ``neutral`` values, which mean "off"; any other value is an error that names the key, its value and ``why``."""

    neutral: tuple[Any, ...]
    why: str


@dataclass(frozen=True)
class Skip:
    """What a :class:`Derive` function may return instead of targets: the key is listed as ignored with ``why``
    (a reason that depends on the value, where ``note`` would not say it)."""

    why: str


@dataclass(frozen=True)
class Derive:
    """The key's value is turned into Inflight keys by ``fn(value, source) -> [(target, value), ...]``, which may
    read other keys of the resolved ``source`` recipe and raises :class:`TranslationError` for a value it cannot
    express; ``note`` says what it does, for the summary and the docs."""

    fn: Callable[[Any, Source], list[tuple[Path, Any]] | Skip]
    note: str
    """What it does; the reason listed when ``fn`` returns nothing. A :class:`TranslationError` raised with an empty
    path is given the key's path; a :class:`Skip` returned lists the key as ignored with its own reason."""


@dataclass(frozen=True)
class When:
    """``then`` when ``test(source)`` holds, else ``otherwise``; ``None`` means no rule (the key passes through as
    an Inflight key). For keys whose meaning depends on another key, e.g. on which backend NeMo-RL trains with;
    ``note`` names the condition, for the docs."""

    test: Callable[[Source], bool]
    then: Rule | None
    otherwise: Rule | None
    note: str


Rule = Rename | Ignore | NeutralOnly | Derive | When
Table = Mapping[Path, Rule]
"""Rules by exact path or ``prefix.*`` pattern."""


@dataclass(frozen=True)
class Source:
    """The resolved NeMo-RL recipe, read by :class:`Derive` rules."""

    data: Mapping[str, Any]

    def get(self, path: Path, default: Any = None) -> Any:
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node


@dataclass(frozen=True)
class Mapped:
    source: Path
    target: Path
    value: Any


@dataclass(frozen=True)
class Ignored:
    source: Path
    value: Any
    why: str


@dataclass
class TranslationReport:
    """What the translator did with every leaf key of the source recipe."""

    mapped: list[Mapped] = field(default_factory=list)
    """Keys renamed or derived into Inflight keys."""
    ignored: list[Ignored] = field(default_factory=list)
    """Keys dropped, each with its reason."""
    kept: list[Path] = field(default_factory=list)
    """Keys that are Inflight keys already (same path, same meaning)."""
    unknown: list[Path] = field(default_factory=list)
    """Keys with no rule that are not Inflight keys either; passed on for the schema to reject."""
    errors: list[TranslationError] = field(default_factory=list)
    """Keys whose value Inflight cannot honour (only with ``translate(strict=False)``; otherwise the first raises)."""
    leaves: int = 0
    """Leaf keys of the source recipe."""
    resolved: list[ResolvedPath] = field(default_factory=list)
    """Relative paths found from the recipe file's directory, not the current one (set by the recipe loader;
    ``inflight validate``/``run``/``attach`` print one line each)."""

    def counts(self) -> dict[str, int]:
        """Leaf keys of the source and how many were kept, mapped (counted once per source key), ignored, unknown."""
        return {"leaves": self.leaves, "kept": len(self.kept), "mapped": len({m.source for m in self.mapped}),
                "ignored": len(self.ignored), "unknown": len(self.unknown), "errors": len(self.errors)}

    def summary(self, max_keys: int | None = 3) -> str:
        """The ignored keys for ``inflight validate``/``run``/``attach``: a header with the counts, then by top-level
        section (with its count) one line per reason, each reason once, naming at most ``max_keys`` of its keys
        (None: all) and how many there are; a reason whose keys span sections is listed under its first key's."""
        by_why: dict[str, list[Path]] = {}
        for item in self.ignored:
            by_why.setdefault(item.why, []).append(item.source)
        by_section: dict[str, list[tuple[str, list[Path]]]] = {}
        for why, keys in by_why.items():
            by_section.setdefault(keys[0].split(".")[0], []).append((why, keys))
        n = self.counts()
        lines = [f"{n['ignored']} of {n['leaves']} recipe keys have no meaning here ({n['kept']} kept, {n['mapped']} "
                 f"mapped); by section, each reason once:"]
        for section, groups in by_section.items():
            lines.append(f"{section}: {sum(len(keys) for _, keys in groups)} ignored")
            for why, keys in groups:
                shown = keys if max_keys is None or len(keys) <= max_keys else keys[:max_keys]
                more = f" (+{len(keys) - len(shown)} more; {len(keys)} in all)" if len(shown) < len(keys) else ""
                lines.append(f"  ignored: {', '.join(shown)}{more}: {why}")
        return "\n".join(lines)


def leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[Path, Any]]:
    """Every leaf ``(path, value)``: a value that is not a mapping, or an empty mapping."""
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from leaves(value, path + ".")
        else:
            yield path, value


def find_rule(table: Table, path: Path) -> Rule | None:
    """The rule for ``path``: an exact entry, else the longest matching ``prefix.*`` pattern."""
    if path in table:
        return table[path]
    parts = path.split(".")
    for n in range(len(parts) - 1, 0, -1):
        rule = table.get(".".join(parts[:n]) + ".*")
        if rule is not None:
            return rule
    return None


def pick_rule(rule: Rule | None, src: Source) -> Rule | None:
    """The rule that applies to ``src``: ``rule`` with every :class:`When` decided."""
    while isinstance(rule, When):
        rule = rule.then if rule.test(src) else rule.otherwise
    return rule


def _set(out: dict, target: Path, value: Any, source: Path, origin: dict[Path, Path]) -> None:
    parts = target.split(".")
    node = out
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise TranslationError(source, f"maps to {target}, but {p} is already set to a value")
    leaf = parts[-1]
    if leaf in node and node[leaf] != value:
        raise TranslationError(source, f"maps to {target} = {value!r}, which {origin[target]} already set to "
                                       f"{node[leaf]!r}")
    node[leaf] = value
    origin[target] = source


def _same(value: Any, neutral: Any) -> bool:
    """Equal, without counting ``True == 1`` or ``0 == False``."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return isinstance(value, bool) and isinstance(neutral, bool) and value == neutral
    return value == neutral


def _one(path: Path, value: Any, rule: Rule | None, src: Source, out: dict, origin: dict[Path, Path],
         report: TranslationReport, is_inflight_key: Callable[[Path], bool]) -> None:
    if rule is None:
        _set(out, path, value, path, origin)
        (report.kept if is_inflight_key(path) else report.unknown).append(path)
    elif isinstance(rule, Rename):
        new = rule.convert(value) if rule.convert else value
        _set(out, rule.target, new, path, origin)
        report.mapped.append(Mapped(path, rule.target, new))
    elif isinstance(rule, Ignore):
        report.ignored.append(Ignored(path, value, rule.why))
    elif isinstance(rule, NeutralOnly):
        if not any(_same(value, n) for n in rule.neutral):
            want = f"; expected {' or '.join(repr(n) for n in rule.neutral)}" if rule.neutral else ""
            raise TranslationError(path, f"{value!r} is not supported ({rule.why}){want}")
        report.ignored.append(Ignored(path, value, rule.why))
    elif isinstance(rule, Derive):
        try:
            targets = rule.fn(value, src)
        except TranslationError as err:
            raise (err if err.path else TranslationError(path, err.reason)) from None
        if isinstance(targets, Skip) or not targets:
            report.ignored.append(Ignored(path, value, targets.why if isinstance(targets, Skip) else rule.note))
            return
        for target, new in targets:
            _set(out, target, new, path, origin)
            report.mapped.append(Mapped(path, target, new))


def translate(data: Mapping[str, Any], table: Table, is_inflight_key: Callable[[Path], bool], strict: bool = True
              ) -> tuple[dict, TranslationReport]:
    """Apply ``table`` to every leaf of ``data`` (a resolved recipe, plain dicts); returns the Inflight recipe data
    and the report. ``is_inflight_key`` says whether a path is a key of Inflight's recipe schema. The first
    :class:`TranslationError` is raised; with ``strict=False`` each is kept in ``report.errors`` instead and the
    translation goes on (for reports and docs)."""
    src = Source(data)
    out: dict = {}
    origin: dict[Path, Path] = {}
    report = TranslationReport()
    for path, value in leaves(data):
        report.leaves += 1
        try:
            _one(path, value, pick_rule(find_rule(table, path), src), src, out, origin, report, is_inflight_key)
        except TranslationError as err:
            if strict:
                raise
            report.errors.append(err)
    return out, report
