"""Finding where a data file is bad, for the error message: the line of a JSONL file that is not UTF-8 or not JSON,
the line a row came from, the column of a row that is not UTF-8, and the file, column and row of a glob whose files
give one column different types.

Hugging Face ``datasets`` reads the files (services/data/dataset.py); these functions run only once it has failed,
and re-read just enough of the file to name the place (``datasets`` itself names neither file nor line).
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

JSON_LINES = (".jsonl", ".json")
"""Suffixes read by the ``json`` builder, one JSON object per line (a ``.json`` file may also be one document)."""


def json_lines(path: str) -> bool:
    """Whether ``path`` is a JSON Lines file (a ``.jsonl``, or a ``.json`` whose first character is ``{``)."""
    suffix = Path(path).suffix.lower()
    if suffix not in JSON_LINES:
        return False
    if suffix == ".jsonl":
        return True
    with open(path, "rb") as f:
        return f.read(4096).lstrip()[:1] == b"{"


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    """``(line number from 1, line)`` of the non-blank lines (``datasets`` skips blank ones)."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield n, line


def bad_json_line(path: str) -> str | None:
    """``line N: why`` for the first line of a JSON Lines file that is not UTF-8 or not one JSON object; None when
    every line is (or the file is one JSON document: the reason is then its parser's)."""
    if not json_lines(path):
        return _bad_json_document(path)
    for n, line in _lines(path):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"line {n}: invalid UTF-8 (byte {e.start + 1} of the line: {e.reason})"
        try:
            value = json.loads(text.strip())
        except json.JSONDecodeError as e:
            return f"line {n}: not valid JSON ({e.msg} at column {e.colno})"
        if not isinstance(value, dict):
            return f"line {n}: expected a JSON object {{...}}, got {type(value).__name__}"
    return None


def _bad_json_document(path: str) -> str | None:
    data = Path(path).read_bytes()
    try:
        json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        return f"line {line}: invalid UTF-8 ({e.reason})"
    except json.JSONDecodeError as e:
        return f"line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})"
    return None


def line_of_row(path: str, row: int) -> int | None:
    """The line number (from 1) of row ``row`` (from 0) of a JSON Lines file; None for other files."""
    if not json_lines(path):
        return None
    for k, (n, _) in enumerate(_lines(path)):
        if k == row:
            return n
    return None


def undecodable_column(table: Any) -> str | None:
    """The first column of a one-row ``pyarrow.Table`` whose value is not valid UTF-8."""
    for name in table.column_names:
        try:
            table.column(name).to_pylist()
        except UnicodeDecodeError:
            return name
    return None


def type_mismatch(files: Sequence[str], parts: Sequence[Any]) -> str | None:
    """``column 'c' is string in A but int64 in B (row r)`` for the first column to which two of ``parts`` (one
    ``datasets.Dataset`` per file) give different types (a column that is all null in a file has no type there);
    None when none does."""
    seen: dict[str, tuple[Any, str, Any]] = {}
    for f, part in zip(files, parts, strict=True):
        for col, feature in part.features.items():
            if _null(feature):
                continue
            if col not in seen:
                seen[col] = (feature, f, part)
                continue
            first, first_file, first_part = seen[col]
            if first != feature:
                want = _value_type(first_part, col)
                row = _first_row(part, col, want, f)
                at = "" if row is None else f" (first at row {row}{_line(f, row)})"
                return (f"column {col!r} is {_name(first)} in {first_file} but {_name(feature)} in {f}{at}")
    return None


def _line(path: str, row: int) -> str:
    n = line_of_row(path, row)
    return "" if n is None else f", line {n}"


def _null(feature: Any) -> bool:
    return getattr(feature, "dtype", None) == "null"


def _name(feature: Any) -> str:
    """``string``, ``int64``... for a plain column; ``mixed types`` for a file whose rows already disagree."""
    kind = type(feature).__name__
    dtype = getattr(feature, "dtype", None)
    return str(dtype) if kind == "Value" and isinstance(dtype, str) else "mixed types" if kind == "Json" else \
        str(feature)


def _values(part: Any, col: str) -> Iterator[tuple[int, Any]]:
    r = 0
    for batch in part.select_columns([col]).iter(batch_size=1024):
        for v in batch[col]:
            yield r, v
            r += 1


def _value_type(part: Any, col: str) -> type | None:
    """The Python type of the column's first value that is not null."""
    return next((type(v) for _, v in _values(part, col) if v is not None), None)


def _first_row(part: Any, col: str, other_than: type | None, path: str) -> int | None:
    """The first row whose value is not null and not of type ``other_than``; of a JSON Lines file read from its
    lines (``datasets`` gives a column of mixed types the ``Json`` type, whose values lose the string quotes)."""
    values = _values(part, col) if not json_lines(path) else \
        ((r, _field(line, col)) for r, (_, line) in enumerate(_lines(path)))
    return next((r for r, v in values if v is not None and type(v) is not other_than), None)


def _field(line: bytes, col: str) -> Any:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value.get(col) if isinstance(value, dict) else None
