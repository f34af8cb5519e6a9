"""Rows of ``data.train_data_path`` / ``data.val_data_path`` read through Hugging Face ``datasets`` (memory-mapped
Arrow: only the rows drawn are turned into Python objects), and the mapping of one row to a prompt.

A path is a JSONL (``.jsonl``/``.json``), Parquet or CSV file, a glob of such files (one format), or a directory
written by ``datasets.Dataset.save_to_disk``. Row ``i`` of :class:`Rows` is row ``i`` of the files in sorted order;
errors name the file and the row within it (0-based).

The task a reward function sees (``PromptRequest.task``, whose values the protocol limits to strings and finite
numbers): ``answer`` is ``data.output_key``'s value as a string (an integral float such as ``12.0``, which CSV
columns with gaps produce, becomes ``"12"``); every other column is metadata, converted as follows: strings,
ints and finite floats as they are; ``bool`` -> ``0``/``1``; ``None``, NaN and infinities -> the key is left out;
lists and dicts -> a JSON string; anything else -> ``str(value)``. A metadata column named ``answer`` is replaced
by the reference. A string over ``protocol.fields.MAX_STRING_CHARS`` makes the row invalid.
"""
from __future__ import annotations

import glob
import json
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.fields import MAX_STRING_CHARS
from services.config_data import DataConfig

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File suffix -> ``datasets`` builder."""


class DataError(ValueError):
    """A row (or a whole file) that cannot become a prompt; the message names the file, row and key."""


class InvalidRow(ValueError):
    """One row's key is missing, of the wrong type or empty (``key`` and ``why``; the caller adds file and row)."""

    def __init__(self, key: str, why: str):
        super().__init__(f"key {key!r}: {why}")
        self.key, self.why = key, why


@dataclass
class Rows:
    """The rows of one data path, memory-mapped; ``row(i)`` is a dict, ``where(i)`` names its file and row."""

    path: str
    dataset: Any
    """A ``datasets.Dataset`` (the files concatenated in sorted order)."""
    files: list[str]
    starts: list[int] = field(default_factory=list)
    """First row of each file (one entry per file; a ``save_to_disk`` directory counts as one file)."""

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def columns(self) -> list[str]:
        return list(self.dataset.column_names)

    def row(self, i: int) -> dict:
        return self.dataset[int(i)]

    def where(self, i: int) -> str:
        k = bisect_right(self.starts, i) - 1
        return f"{self.files[k]} row {i - self.starts[k]}"


def load_rows(path: str, key: str = "data.train_data_path", cache_dir: str | None = None) -> Rows:
    """The rows at ``path`` (see the module docstring); ``key`` names the setting in errors; ``cache_dir``: where
    ``datasets`` keeps the Arrow files it converts JSONL/CSV/Parquet into (default: its own cache)."""
    import datasets

    p = Path(path).expanduser()
    if p.is_dir():
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            raise DataError(f"{key} {path!r}: a DatasetDict (splits {sorted(ds)}); give the directory of one split")
        return Rows(path, ds, [str(p)], [0])
    files = sorted(glob.glob(str(p))) if glob.has_magic(str(p)) else [str(p)] if p.exists() else []
    if not files:
        raise FileNotFoundError(f"{key} {path!r}: no such file (expected a JSONL, Parquet or CSV file, a glob of "
                                f"them, or a datasets.save_to_disk directory)")
    builders = {FORMATS.get(Path(f).suffix.lower(), "") for f in files}
    if "" in builders or len(builders) != 1:
        raise DataError(f"{key} {path!r}: expected files of one format among {sorted(FORMATS)}, got "
                        f"{sorted({Path(f).suffix for f in files})}")
    builder = builders.pop()
    parts, starts, n = [], [], 0
    for f in files:
        part = datasets.load_dataset(builder, data_files=[f], split="train", cache_dir=cache_dir)
        parts.append(part)
        starts.append(n)
        n += len(part)
    ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return Rows(path, ds, files, starts)


@dataclass(frozen=True)
class MappedRow:
    """One row as a prompt: either ``text`` (``data.input_key``) or ``turns`` (``data.messages_key``)."""

    text: str | None
    turns: list[dict[str, str]] | None
    task: dict[str, str | int | float]


@dataclass(frozen=True)
class RowMapper:
    """``data.input_key`` / ``output_key`` / ``messages_key`` applied to one row."""

    input_key: str
    output_key: str
    messages_key: str

    @classmethod
    def of(cls, d: DataConfig) -> RowMapper:
        return cls(d.input_key, d.output_key, d.messages_key)

    def check_columns(self, rows: Rows, key: str) -> None:
        """Fail at once when no row can have a prompt or an answer (the column is absent from the whole file)."""
        cols = rows.columns
        if self.input_key not in cols and self.messages_key not in cols:
            raise DataError(f"{key} {rows.path!r}: no column {self.input_key!r} (data.input_key) or "
                            f"{self.messages_key!r} (data.messages_key); columns: {cols}")
        if self.output_key not in cols:
            raise DataError(f"{key} {rows.path!r}: no column {self.output_key!r} (data.output_key); columns: {cols}")

    def map(self, row: dict) -> MappedRow:
        """The prompt and task of ``row``; raises :class:`InvalidRow` naming the key."""
        turns = _turns(row.get(self.messages_key), self.messages_key)
        text = None
        if turns is None:
            text = row.get(self.input_key)
            if text is None:
                raise InvalidRow(self.input_key, f"missing (and no {self.messages_key!r} chat turns)")
            if not isinstance(text, str):
                raise InvalidRow(self.input_key, f"expected a string, got {type(text).__name__}")
            if not text.strip():
                raise InvalidRow(self.input_key, "empty prompt")
        task = {}
        for k, v in row.items():
            if k in (self.input_key, self.messages_key, self.output_key):
                continue
            value = metadata_value(v, k)
            if value is not None:
                task[k] = value
        task["answer"] = _answer(row.get(self.output_key), self.output_key)
        return MappedRow(text, turns, task)


def _turns(v: Any, key: str) -> list[dict[str, str]] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v:
        raise InvalidRow(key, f"expected a non-empty list of {{role, content}} turns, got "
                              f"{type(v).__name__ if not isinstance(v, list) else 'an empty list'}")
    out = []
    for j, t in enumerate(v):
        if not isinstance(t, dict) or not isinstance(t.get("role"), str) or not isinstance(t.get("content"), str):
            raise InvalidRow(key, f"turn {j}: expected {{role: str, content: str}}, got {t!r:.80}")
        out.append({"role": t["role"], "content": t["content"]})
    if not any(t["content"].strip() for t in out):
        raise InvalidRow(key, "empty prompt (every turn's content is empty)")
    return out


def _answer(v: Any, key: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        raise InvalidRow(key, "missing reference answer")
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise InvalidRow(key, f"expected a string or number, got {type(v).__name__}")
    if isinstance(v, float):
        if not math.isfinite(v):
            raise InvalidRow(key, f"expected a finite number, got {v}")
        v = int(v) if v.is_integer() else v
    s = str(v)
    if len(s) > MAX_STRING_CHARS:
        raise InvalidRow(key, f"longer than {MAX_STRING_CHARS} chars ({len(s)})")
    return s


def metadata_value(v: Any, key: str) -> str | int | float | None:
    """A column's value as the protocol carries it (module docstring); None: leave the key out."""
    if v is None:
        return None
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, (list, dict)):
        v = json.dumps(v, default=str)
    s = v if isinstance(v, str) else str(v)
    if len(s) > MAX_STRING_CHARS:
        raise InvalidRow(key, f"longer than {MAX_STRING_CHARS} chars ({len(s)}) for the reward's task")
    return s
