"""Rows of ``data.train_data_path`` / ``data.val_data_path`` read through Hugging Face ``datasets`` (memory-mapped
Arrow: only the rows drawn are turned into Python objects), and the mapping of one row to a prompt.

A path is a JSONL (``.jsonl``/``.json``), Parquet or CSV file, a glob of such files (one format), a directory
written by ``datasets.Dataset.save_to_disk``, or a Hugging Face Hub dataset ``hf://<owner>/<name>`` (one split,
``datasets.load_dataset`` at run time; without the Hub or a cached copy it fails, naming the dataset). Row ``i`` of
:class:`Rows` is row ``i`` of the files in sorted order; errors name the file and the row within it (0-based),
and for JSONL the line (a line that is not UTF-8 or not JSON, a glob whose files give a column different types:
services/data/data_errors.py).
:func:`split_rows` holds out a seeded share of the rows (``data.split_validation_size``): both parts keep the
file's row numbers.

``data.input_key`` / ``output_key`` name a column, or a dotted path into nested ones (``prompt.0.content``).

The task a reward function sees (``PromptRequest.task``, whose values the protocol limits to strings and finite
numbers): ``answer`` is ``data.output_key``'s value as a string (an integral float such as ``12.0``, which CSV
columns with gaps produce, becomes ``"12"``); every other column is metadata, converted as follows: strings,
ints and finite floats as they are; ``bool`` -> ``0``/``1``; ``None``, NaN and infinities -> the key is left out;
an image of a ``datasets.Image`` column -> its path (its bytes stay out); lists and dicts -> a JSON string;
anything else -> ``str(value)``. A metadata column named ``answer`` is replaced
by the reference (``data.task_columns``, when set, names the metadata columns kept). A string over
``protocol.fields.MAX_STRING_CHARS`` makes the row invalid.
"""
from __future__ import annotations

import glob
import json
import math
import os
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from protocol.fields import MAX_STRING_CHARS
from services.data.data_errors import bad_json_line, line_of_row, type_mismatch, undecodable_column
from services.recipe.data import HUB_PREFIX, DataConfig, hub_id

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
    indices: np.ndarray | None = None
    """The rows of ``dataset`` this set is, in this order (a :func:`split_rows` part); None: all, in order."""
    _arrow: Any = field(default=None, init=False, repr=False, compare=False)
    _features: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self._arrow = self.dataset.with_format("arrow")
        self._features = media_undecoded(self.dataset.features)

    def __len__(self) -> int:
        return len(self.dataset) if self.indices is None else len(self.indices)

    @property
    def columns(self) -> list[str]:
        return list(self.dataset.column_names)

    def source_row(self, i: int) -> int:
        """Row ``i`` of this set as a row of the whole data (ids and messages use it)."""
        return int(i) if self.indices is None else int(self.indices[i])

    def row(self, i: int) -> dict:
        """Row ``i`` as a dict, as ``dataset[i]`` gives it except that images (audio, video) stay ``{bytes, path}``
        (:func:`media_undecoded`); :class:`InvalidRow` naming the column when a value is not valid UTF-8."""
        j = self.source_row(i)
        try:
            return self._features.decode_example(self._arrow[j].to_pylist()[0])
        except UnicodeDecodeError as e:
            column = undecodable_column(self.dataset.with_format("arrow")[j]) or "(a column)"
            k = bisect_right(self.starts, j) - 1
            line = line_of_row(self.files[k], j - self.starts[k]) if Path(self.files[k]).is_file() else None
            at = "" if line is None else f", line {line} of {self.files[k]}"
            raise InvalidRow(column, f"invalid UTF-8 ({e.reason} at byte {e.start + 1} of the value{at})") from e

    def where(self, i: int) -> str:
        j = self.source_row(i)
        k = bisect_right(self.starts, j) - 1
        return f"{self.files[k]} row {j - self.starts[k]}"

    def base_dir(self, i: int) -> str | None:
        """The directory of row ``i``'s file, against which its relative image paths are read (None for a hub
        data set)."""
        k = bisect_right(self.starts, self.source_row(i)) - 1
        path = Path(self.files[k]) if self.files else None
        return None if path is None or not path.exists() else str(path if path.is_dir() else path.parent)


def media_undecoded(features: Any) -> Any:
    """A copy of the ``datasets.Features`` ``features`` in which no image, audio or video column is decoded: their
    values stay ``{bytes, path}`` for the image preparation to read under its rules (docs/security.md). Decoding
    them is what ``datasets`` does otherwise: Pillow with every format it knows (EPS among them) on a path read from
    anywhere."""
    import copy

    import datasets

    out = copy.deepcopy(features)

    def walk(f: Any) -> None:
        if isinstance(f, dict):
            for v in f.values():
                walk(v)
        elif isinstance(f, list | tuple):
            for v in f:
                walk(v)
        elif hasattr(f, "feature"):
            walk(f.feature)
        elif hasattr(f, "decode_example") and getattr(f, "decode", None) is True and type(f).__name__ != "Json":
            f.decode = False

    walk(out)
    return datasets.Features(out)


def split_rows(rows: Rows, size: float, seed: int) -> tuple[Rows, Rows]:
    """``(train, held_out)``: ``size`` (a fraction in (0, 1): ``ceil(size x n)`` rows, or a whole number of rows)
    of ``rows`` held out, chosen as the first of ``numpy.random.default_rng(seed).permutation(n)`` and the rest in
    that order; the split of ``datasets.Dataset.train_test_split(test_size=size, seed=seed)``, which NeMo-RL's
    ``split_validation_size`` uses. No row is in both."""
    n = len(rows)
    n_test = math.ceil(size * n) if size < 1 else int(size)
    if not 0 < n_test < n:
        raise DataError(f"data.split_validation_size ({size:g}) of {rows.path!r}: {n_test} of its {n} rows held out "
                        f"for validation, expected at least 1 and fewer than all")
    base = np.arange(n) if rows.indices is None else rows.indices
    perm = base[np.random.default_rng(seed).permutation(n)]
    return Rows(rows.path, rows.dataset, rows.files, rows.starts, perm[n_test:]), \
        Rows(rows.path, rows.dataset, rows.files, rows.starts, perm[:n_test])


def load_hub_rows(path: str, split: str | None, key: str, cache_dir: str | None = None) -> Rows:
    """The rows of split ``split`` (default ``train``) of the Hub dataset ``hf://<owner>/<name>``. Without network
    the datasets cache must hold it; a miss is a :class:`DataError` that names the dataset and says so."""
    import datasets

    repo, split = hub_id(path, key), split or "train"
    try:
        ds = datasets.load_dataset(repo, split=split, cache_dir=cache_dir)
    except ConnectionError as e:
        offline = " (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE is set, so only the cache is read)" \
            if _offline() else ""
        raise DataError(f"{key} {path!r}: Hugging Face Hub dataset {repo!r} (split {split!r}) could not be loaded: "
                        f"{e}. It is read from the Hub when the run starts: it needs network access to the Hub, or "
                        f"a copy in the datasets cache (HF_DATASETS_CACHE, default under HF_HOME){offline}, or a local "
                        f"copy: the split saved with datasets' save_to_disk, given as {key} (in a NeMo-RL recipe: "
                        f"data.<train|validation>.data_path beside its dataset_name)") from e
    except Exception as e:  # a wrong split or a broken dataset: say which dataset it was
        raise DataError(f"{key} {path!r}: Hugging Face Hub dataset {repo!r} (split {split!r}): "
                        f"{type(e).__name__}: {e}") from e
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{key} {path!r}: expected one split of {repo!r}, got {type(ds).__name__}")
    return Rows(path, ds, [f"{path} split {split}"], [0])


def _offline() -> bool:
    return any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE") for k in
               ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def load_rows(path: str, key: str = "data.train_data_path", cache_dir: str | None = None,
              split: str | None = None) -> Rows:
    """The rows at ``path`` (see the module docstring); ``key`` names the setting in errors; ``cache_dir``: where
    ``datasets`` keeps the Arrow files it converts JSONL/CSV/Parquet into (default: its own cache); ``split``: of an
    ``hf://`` path."""
    import datasets

    if path.startswith(HUB_PREFIX):
        return load_hub_rows(path, split, key, cache_dir)
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
        try:
            part = datasets.load_dataset(builder, data_files=[f], split="train", cache_dir=cache_dir)
        except Exception as e:  # datasets names neither file nor line: find them, say them
            raise DataError(_unreadable(key, f, builder, e)) from e
        parts.append(part)
        starts.append(n)
        n += len(part)
    try:
        ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    except ValueError as e:  # "The features can't be aligned": name the file, column and row
        where = type_mismatch(files, parts) or str(e)
        raise DataError(f"{key} {path!r}: {where}; every file of a glob must give a column one type (write the "
                        f"values of one type, e.g. quote the numbers)") from e
    return Rows(path, ds, files, starts)


def _unreadable(key: str, path: str, builder: str, e: Exception) -> str:
    """The error of a file ``datasets`` cannot read: the bad line of a JSON file, else the reader's reason."""
    where = bad_json_line(path) if builder == "json" else None
    cause = e.__cause__ or e
    why = where or f"{type(cause).__name__}: {str(cause)[:500]}"
    expected = "one JSON object per line, UTF-8" if builder == "json" else f"a readable {builder} file"
    return f"{key}: {path}: {why} (expected {expected})"


@dataclass(frozen=True)
class MappedRow:
    """One row as a prompt: either ``text`` (``data.input_key``) or ``turns`` (``data.messages_key``)."""

    text: str | None
    turns: list[dict[str, str]] | None
    task: dict[str, str | int | float]


@dataclass(frozen=True)
class RowMapper:
    """``data.input_key`` / ``output_key`` / ``messages_key`` / ``task_columns`` applied to one row."""

    input_key: str
    output_key: str
    messages_key: str
    task_columns: tuple[str, ...] | None = None
    """Metadata columns kept (None: all but the prompt's, the answer's and the images')."""
    image_key: str | None = None
    """The images' column (``data.image_key``): never task metadata."""

    @classmethod
    def of(cls, d: DataConfig) -> RowMapper:
        cols = None if d.task_columns is None else tuple(d.task_columns)
        return cls(d.input_key, d.output_key, d.messages_key, cols, d.image_key)

    def check_columns(self, rows: Rows, key: str) -> None:
        """Fail at once when no row can have a prompt or an answer (the column is absent from the whole file)."""
        cols = rows.columns
        if _column(self.input_key, cols) not in cols and self.messages_key not in cols:
            raise DataError(f"{key} {rows.path!r}: no column {self.input_key!r} (data.input_key) or "
                            f"{self.messages_key!r} (data.messages_key); columns: {cols}")
        if _column(self.output_key, cols) not in cols:
            raise DataError(f"{key} {rows.path!r}: no column {self.output_key!r} (data.output_key); columns: {cols}")
        missing = [c for c in self.task_columns or () if c not in cols]
        if missing:
            raise DataError(f"{key} {rows.path!r}: no column {missing[0]!r} (data.task_columns); columns: {cols}")

    def map(self, row: dict) -> MappedRow:
        """The prompt and task of ``row``; raises :class:`InvalidRow` naming the key."""
        turns = _turns(row.get(self.messages_key), self.messages_key)
        text = None
        if turns is None:
            text = lookup(row, self.input_key)
            if text is None:
                raise InvalidRow(self.input_key, f"missing (and no {self.messages_key!r} chat turns)")
            if not isinstance(text, str):
                raise InvalidRow(self.input_key, f"expected a string, got {type(text).__name__}")
            if not text.strip():
                raise InvalidRow(self.input_key, "empty prompt")
        task = {}
        skip = {_column(self.input_key, row), self.messages_key, _column(self.output_key, row), self.image_key}
        for k in (row if self.task_columns is None else self.task_columns):
            if k in skip:
                continue
            value = metadata_value(row.get(k), k)
            if value is not None:
                task[k] = value
        task["answer"] = _answer(lookup(row, self.output_key), self.output_key)
        return MappedRow(text, turns, task)


def _column(key: str, columns) -> str:
    """The column ``key`` reads: itself when a column has that name, else the first part of its dotted path."""
    return key if key in columns else key.split(".", 1)[0]


def lookup(row: dict, key: str) -> Any:
    """``row[key]``, or for a dotted path with no such column the nested value (``prompt.0.content`` is
    ``row["prompt"][0]["content"]``; a part that is a digit indexes a list); None when any part is missing."""
    if key in row or "." not in key:
        return row.get(key)
    node: Any = row
    for part in key.split("."):
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _turns(v: Any, key: str) -> list[dict[str, str]] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v:
        raise InvalidRow(key, f"expected a non-empty list of {{role, content}} turns, got "
                              f"{type(v).__name__ if not isinstance(v, list) else 'an empty list'}")
    out = []
    for j, t in enumerate(v):
        if isinstance(t, dict) and (audio := _audio_part(t.get("content"))) is not None:
            raise InvalidRow(key, f"turn {j}: a {audio!r} part: audio inputs are not supported (text turns only; a "
                                  f"row's images come from data.image_key)")
        if not isinstance(t, dict) or not isinstance(t.get("role"), str) or not isinstance(t.get("content"), str):
            raise InvalidRow(key, f"turn {j}: expected {{role: str, content: str}}, got {t!r:.80}")
        out.append({"role": t["role"], "content": t["content"]})
    if not any(t["content"].strip() for t in out):
        raise InvalidRow(key, "empty prompt (every turn's content is empty)")
    return out


AUDIO_PART_TYPES = ("audio", "input_audio", "audio_url")
"""Content-part types of an audio input (transformers' chat messages, OpenAI's): Nano-Omni's audio tower is not
supported, so a row that has one is refused by name rather than failing as a malformed turn."""


def _audio_part(content: Any) -> str | None:
    """The type of the first audio part of a turn's ``content`` given as a list of parts, else None."""
    if not isinstance(content, list):
        return None
    return next((p["type"] for p in content if isinstance(p, dict) and p.get("type") in AUDIO_PART_TYPES), None)


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
    if isinstance(v, dict) and set(v) <= {"bytes", "path"} and isinstance(v.get("bytes"), bytes | None):
        return metadata_value(v.get("path"), key)  # an image column that is not data.image_key: its path only
    if isinstance(v, (list, dict)):
        v = json.dumps(v, default=str)
    s = v if isinstance(v, str) else str(v)
    if len(s) > MAX_STRING_CHARS:
        raise InvalidRow(key, f"longer than {MAX_STRING_CHARS} chars ({len(s)}) for the reward's task")
    return s
