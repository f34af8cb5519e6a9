"""The model directory a run uses: ``policy.model_name`` with ``policy.tokenizer.name``'s tokenizer and
``policy.hf_config_overrides`` applied (NeMo-RL's meanings).

When neither is set (or the tokenizer is the model's own) the model's directory is used as it is. Otherwise a
variant directory is made under the cache: every file of the model linked (not copied), ``config.json`` written
with the overrides set on its top-level keys (as NeMo-RL passes them to ``AutoConfig.from_pretrained``, and to
vLLM), and the tokenizer's files linked from the tokenizer's directory in place of the model's. The learner, the
engines, the prompts and ``inflight export`` all read that one directory, so they agree on both.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Protocol

from services.models.source import CACHE, resolve_model

TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                             "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                             "chat_template.jinja", "chat_template.json"})
"""The files that make a Hugging Face tokenizer (what ``AutoTokenizer.from_pretrained`` reads)."""
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")
"""A directory holds a tokenizer when it has one of these (what the run loads the tokenizer from)."""


def has_tokenizer(directory: Path) -> bool:
    """Whether ``directory`` holds a tokenizer (:data:`TOKENIZER_MARKERS`)."""
    return any((directory / f).is_file() for f in TOKENIZER_MARKERS)


class TokenizerChoice(Protocol):
    """What the recipe's ``policy.tokenizer`` says of the tokenizer (read only)."""
    @property
    def name(self) -> str | None: ...


class PolicyModel(Protocol):
    """What the recipe's ``policy`` section says of the model (read only; the models wing imports no recipe)."""
    @property
    def model_name(self) -> str: ...
    @property
    def tokenizer(self) -> TokenizerChoice: ...
    @property
    def hf_config_overrides(self) -> dict[str, Any]: ...


def resolve_policy_model(policy: PolicyModel) -> str:
    """The directory the run loads the model, its config and its tokenizer from (see the module's docstring)."""
    model_dir = resolve_model(policy.model_name)
    tokenizer = policy.tokenizer.name
    tokenizer_dir = None if tokenizer is None else Path(tokenizer).expanduser().resolve()
    if tokenizer_dir is not None and tokenizer_dir == Path(model_dir):
        tokenizer_dir = None
    if tokenizer_dir is None and not policy.hf_config_overrides:
        return model_dir
    return str(model_variant(Path(model_dir), tokenizer_dir, policy.hf_config_overrides))


def model_variant(model_dir: Path, tokenizer_dir: Path | None, overrides: dict[str, Any]) -> Path:
    """The variant directory of ``model_dir`` with ``tokenizer_dir``'s tokenizer and ``overrides`` in its
    ``config.json``; made once per distinct input (a hash of the paths, the overrides and the model's config)."""
    if tokenizer_dir is not None and not has_tokenizer(tokenizer_dir):
        raise ValueError(f"policy.tokenizer.name: {str(tokenizer_dir)!r} is not a tokenizer directory (no "
                         f"{' or '.join(TOKENIZER_MARKERS)})")
    config = json.loads((model_dir / "config.json").read_text())
    for key in overrides:
        if not isinstance(key, str) or not key:
            raise ValueError(f"policy.hf_config_overrides: keys are config.json field names, got {key!r}")
    config.update(overrides)
    digest = hashlib.sha256(json.dumps([str(model_dir), str(tokenizer_dir), config], sort_keys=True,
                                       default=str).encode()).hexdigest()[:16]
    out = CACHE / "variants" / f"{model_dir.name}-{digest}"
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer_files = {f.name for f in tokenizer_dir.iterdir() if f.name in TOKENIZER_FILES and f.is_file()} \
        if tokenizer_dir is not None else set()
    for src in sorted(model_dir.rglob("*")):
        rel = src.relative_to(model_dir)
        if any(p.startswith(".") for p in rel.parts) or rel.name == "config.json" and len(rel.parts) == 1:
            continue
        if tokenizer_dir is not None and len(rel.parts) == 1 and rel.name in TOKENIZER_FILES:
            continue
        if src.is_dir():
            (tmp / rel).mkdir(parents=True, exist_ok=True)
        else:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).symlink_to(src.resolve())
    for name in sorted(tokenizer_files):
        assert tokenizer_dir is not None
        (tmp / name).symlink_to((tokenizer_dir / name).resolve())
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    try:
        os.rename(tmp, out)
    except OSError:  # another process made it first: theirs is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return out
