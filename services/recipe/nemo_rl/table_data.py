"""Rules for NeMo-RL's ``data.*`` and ``env.*`` keys.

NeMo-RL describes each dataset in a block — ``data.train`` (a mapping, or a list of them), ``data.validation``
(null, a mapping or a list) — whose missing keys come from ``data.default`` (``update_single_dataset_config``).
Inflight's ``data`` is flat and has one training and at most one validation set. So every key of the three
blocks is read together (:func:`resolve`): each block is merged over ``data.default`` the way NeMo-RL does it,
turned into Inflight keys (a named dataset into its Hugging Face Hub path, split and columns,
:mod:`services.recipe.nemo_rl.datasets`), and each NeMo-RL key yields the Inflight keys its value decided. A key whose
value decided nothing (overridden, or a value NeMo-RL itself does not read for that dataset) is listed as
ignored with its rule's note. Keys the two sets share (columns, templates, ``env_name``) must agree.

Every rule applies to NeMo-RL recipes only (an Inflight recipe's ``data``/``env`` keys pass through as they are).
``env.<name>`` sections: the one the data names is Inflight's ``env.<name>`` (``num_workers``,
``math_verify_impl`` keep their meaning); a section no dataset names is ignored, as NeMo-RL creates only the
environments its data names.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path as FsPath
from typing import Any

from services.recipe.data import MATH_VERIFY_IMPLS
from services.recipe.nemo_rl.datasets import (
    RESPONSE_DATASET,
    RESPONSE_SUFFIXES,
    VLM_ENVS,
    hub_dataset,
    vlm_rewards,
)
from services.recipe.nemo_rl.policy_rules import nemo_rl
from services.recipe.nemo_rl.rules import Derive, Ignore, NeutralOnly, Path, Rule, Source, TranslationError, When

BLOCKS = ("train", "validation")
DATASET_KEYS = ("dataset_name", "data_path", "split", "subset", "input_key", "output_key", "split_validation_size",
                "seed", "prompt_file", "system_prompt_file", "processor", "env_name")
"""The keys of a NeMo-RL dataset block that Inflight reads; any other is an error naming it."""
SHARED = ("data.input_key", "data.output_key", "data.task_columns", "data.prompt_file", "data.system_prompt_file",
          "data.env_name", "data.image_key")
"""Inflight keys the training and the validation set share: both blocks must give the same value."""
MATH_PROCESSORS = ("default", "math_hf_data_processor")
VLM_PROCESSOR = "vlm_hf_data_processor"
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass
class Resolved:
    """What the data blocks say: the Inflight keys each NeMo-RL leaf decided, and the env sections the data names."""

    by_leaf: dict[Path, list[tuple[Path, Any]]] = field(default_factory=dict)
    envs: set[str] = field(default_factory=set)

    def emit(self, leaf: Path, target: Path, value: Any) -> None:
        self.by_leaf.setdefault(leaf, []).append((target, value))


@dataclass(frozen=True)
class Block:
    """One dataset block merged over ``data.default``: key -> (value, the NeMo-RL leaf it came from)."""

    which: str
    eff: dict[str, tuple[Any, Path]]

    def __contains__(self, key: str) -> bool:
        return key in self.eff

    def get(self, key: str, default: Any = None) -> Any:
        return self.eff[key][0] if key in self.eff else default

    def at(self, key: str) -> Path:
        """The NeMo-RL leaf that gave ``key`` (the block itself when the key is absent)."""
        return self.eff[key][1] if key in self.eff else f"data.{self.which}"


def _block(src: Source, which: str) -> Block | None:
    """The block ``data.<which>`` merged over ``data.default`` (NeMo-RL's ``update_single_dataset_config``)."""
    node = src.get(f"data.{which}")
    if node is None:
        return None
    here = f"data.{which}"
    listed = isinstance(node, list)
    if listed:
        if len(node) != 1 or not isinstance(node[0], dict):
            raise TranslationError(here, f"a list of {len(node)} datasets: Inflight trains and validates on one set "
                                         f"each (expected one dataset; merge the rows into one file)")
        node = node[0]
    elif not isinstance(node, dict):
        raise TranslationError(here, f"expected a dataset mapping, got {node!r}")
    default = src.get("data.default") or {}
    eff = {k: (v, f"data.default.{k}") for k, v in default.items()}
    eff.update({k: (v, here if listed else f"{here}.{k}") for k, v in node.items()})
    for k, (v, p) in eff.items():
        if k not in DATASET_KEYS:
            raise TranslationError(p if p.endswith(f".{k}") else f"{p}[0].{k}",
                                   f"{v!r}: a NeMo-RL dataset option Inflight does not have (it reads "
                                   f"{', '.join(DATASET_KEYS)})")
    return Block(which, eff)


def _local_or_hub(value: Any, leaf: Path) -> str:
    """NeMo-RL's ``data_path`` (``load_dataset_from_path``): a file by its suffix, a ``save_to_disk`` directory,
    else a Hub dataset id."""
    if not isinstance(value, str) or not value:
        raise TranslationError(leaf, f"expected a path or a Hub dataset id, got {value!r}")
    suffix = FsPath(value).suffix.lower()
    if suffix in RESPONSE_SUFFIXES or value.startswith("hf://") or FsPath(value).expanduser().exists():
        return value
    if suffix in (".arrow", ".txt"):
        raise TranslationError(leaf, f"{value!r}: {suffix} files are not read here; expected one of "
                                     f"{', '.join(RESPONSE_SUFFIXES)}, a save_to_disk directory or a Hub id")
    if HUB_ID.match(value):
        return f"hf://{value}"
    raise TranslationError(leaf, f"{value!r}: no such file or directory, and not a Hub dataset id <owner>/<name>")


def _dataset(b: Block, out: Resolved) -> dict[Path, tuple[Any, Path]]:
    """Emit the Inflight keys of one block; returns the shared keys' (value, leaf) for the agreement check."""
    path_key, split_key = ("data.train_data_path", "data.train_split") if b.which == "train" else \
        ("data.val_data_path", "data.val_split")
    shared: dict[Path, tuple[Any, Path]] = {}

    def put(leaf: Path, target: Path, value: Any) -> None:
        out.emit(leaf, target, value)
        if target in SHARED:
            shared[target] = (value, leaf)

    name, processor = b.get("dataset_name"), b.get("processor", "default")
    if processor not in (*MATH_PROCESSORS, VLM_PROCESSOR):
        raise TranslationError(b.at("processor"), f"{processor!r}: Inflight's rows become prompts one way "
                                                  f"(math_hf_data_processor's, with the image first for "
                                                  f"{VLM_PROCESSOR}); expected one of "
                                                  f"{', '.join((*MATH_PROCESSORS, VLM_PROCESSOR))}")
    if b.get("subset") is not None:
        raise TranslationError(b.at("subset"), f"{b.get('subset')!r}: Hub dataset configurations (subsets) are not "
                                               f"supported; expected null")
    holds_out, size_leaf = 0.0, b.at("split_validation_size")
    if name is None or name == RESPONSE_DATASET:
        if processor == VLM_PROCESSOR:
            raise TranslationError(b.at("processor"), f"{processor!r} on a data_path dataset: its image column is "
                                                      f"not known here; expected default (and Inflight's "
                                                      f"data.image_key on an Inflight recipe: docs/multimodal.md)")
        if b.get("data_path") is None:
            raise TranslationError(b.at("dataset_name"), "no dataset_name and no data_path: expected one (a NeMo-RL "
                                                         "dataset name, or a data_path with ResponseDataset)")
        p = _local_or_hub(b.get("data_path"), b.at("data_path"))
        put(b.at("data_path"), path_key, p)
        split = b.get("split")
        if split is not None and p.startswith("hf://"):
            put(b.at("split"), split_key, split)
        elif split not in (None, "train"):
            raise TranslationError(b.at("split"), f"{split!r}: a local file has one split; expected 'train' or null")
        for k, default in (("input_key", "input"), ("output_key", "output")):
            if k in b:
                put(b.at(k), f"data.{k}", b.get(k))
            shared.setdefault(f"data.{k}", (default, b.at(k)))
        shared["data.task_columns"] = (None, b.at("data_path"))
        holds_out = b.get("split_validation_size") or 0.0
    else:
        try:
            hd = hub_dataset(name, b.at("dataset_name"))
        except ValueError as e:
            raise TranslationError(b.at("dataset_name"), str(e)) from None
        split = b.get("split") if hd.splits or hd.split_hub_ids else None
        if split is not None and hd.splits and split not in hd.splits:
            raise TranslationError(b.at("split"), f"{split!r}: {name} has the splits {', '.join(hd.splits)}")
        if (processor == VLM_PROCESSOR) != (hd.image_key is not None):
            kind, want = ("vision-language", VLM_PROCESSOR) if hd.image_key else ("text", "default")
            raise TranslationError(b.at("processor" if "processor" in b else "dataset_name"),
                                   f"{processor!r}: {name} is a {kind} dataset; expected {want}")
        hub, hub_split = hd.source(split)
        lead = b.at("dataset_name")
        if b.get("data_path") is not None:  # a local copy of the named set (same columns): Inflight's extension
            put(b.at("data_path"), path_key, _local_or_hub(b.get("data_path"), b.at("data_path")))
        else:
            put(lead, path_key, hub)
            put(b.at("split") if split is not None else lead, split_key, hub_split)
        if hd.image_key is not None:
            put(b.at("processor"), "data.image_key", hd.image_key)
        put(lead, "data.input_key", hd.input_key)
        output = b.get("output_key") if hd.output_key_option and "output_key" in b else hd.output_key
        put(b.at("output_key") if output != hd.output_key else lead, "data.output_key", output)
        put(lead, "data.task_columns", [])
        if hd.holds_out is not None:
            holds_out = b.get("split_validation_size", hd.holds_out) or 0.0
            size_leaf = size_leaf if "split_validation_size" in b else lead
    if holds_out:
        if b.which != "train":
            raise TranslationError(size_leaf, f"{holds_out!r}: a hold-out of the validation set is not supported; "
                                              f"expected 0 (hold rows out of data.train instead)")
        put(size_leaf, "data.split_validation_size", holds_out)
        put(b.at("seed") if "seed" in b else size_leaf, "data.split_validation_seed", b.get("seed", 42))
    for k in ("prompt_file", "system_prompt_file", "env_name"):
        if k in b:
            put(b.at(k), f"data.{k}", b.get(k))
        else:
            shared.setdefault(f"data.{k}", (None, b.at(k)))
    env = b.get("env_name")
    if isinstance(env, str):
        out.envs.add(env)
    return shared


def resolve(src: Source) -> Resolved:
    """Every data block read together (module docstring); raises :class:`TranslationError` naming the key."""
    out = Resolved()
    if src.get("data.train") is None:
        raise TranslationError("data.train", "missing: expected the training dataset (dataset_name or data_path)")
    seen: dict[Path, tuple[Any, Path]] = {}
    for which in BLOCKS:
        b = _block(src, which)
        if b is None:
            continue
        for target, (value, leaf) in _dataset(b, out).items():
            if target in seen and seen[target][0] != value:
                first, first_leaf = seen[target]
                raise TranslationError(leaf, f"gives {target} = {value!r}, but {first_leaf} gives {first!r}: the "
                                             f"training and validation sets share it here (expected the same)")
            seen.setdefault(target, (value, leaf))
    return out


def _data_leaf(leaf: Path, value: Any, src: Source) -> list[tuple[Path, Any]]:
    return resolve(src).by_leaf.get(leaf, [])


def _data_rules() -> dict[Path, Rule]:
    notes = {
        "dataset_name": "a NeMo-RL dataset name becomes its Hugging Face Hub dataset (data.<train|val>_data_path: "
                        "hf://..., its split, input_key, output_key, task_columns: []); ResponseDataset reads "
                        "data_path",
        "data_path": "data.<train|val>_data_path: a local file or save_to_disk directory, or a Hub id as hf://<id>; "
                     "beside a dataset_name, a local copy of that named set (its Hub columns), read instead of the "
                     "Hub (Inflight's extension: NeMo-RL's classes read the Hub)",
        "split": "data.<train|val>_split of a Hub dataset (a named set may keep each split in its own Hub dataset)",
        "subset": "Hub dataset configuration: only null",
        "input_key": "data.input_key, for a data_path dataset (a named dataset has fixed columns)",
        "output_key": "data.output_key, for a data_path dataset or a named one that takes it (OpenMathInstruct-2)",
        "split_validation_size": "data.split_validation_size, for the datasets that hold out a split in NeMo-RL "
                                 "(data_path datasets, OpenMathInstruct-2); the other named sets ignore the key there",
        "seed": "data.split_validation_seed, when rows are held out (split_validation_size > 0)",
        "prompt_file": "data.prompt_file (one {} for the problem, as math_hf_data_processor formats it)",
        "system_prompt_file": "data.system_prompt_file (a system turn first)",
        "processor": "NeMo-RL's math_hf_data_processor (the default): system_prompt_file's text as a system turn, "
                     "prompt_file.format(problem) as the user turn, the model's chat template with "
                     "add_generation_prompt, the answer as the reward's ground truth. That is how every Inflight "
                     "row becomes a prompt and a task (data.prompt_file, data.system_prompt_file, data.output_key "
                     "-> task['answer']), so there is nothing to set. vlm_hf_data_processor: the same, with the "
                     "row's image before the text in the user turn: a vision-language dataset's image column "
                     "becomes data.image_key (clevr-cogent: image)",
        "env_name": "data.env_name: the env.<name> section that scores the rows",
    }
    rules: dict[Path, Rule] = {}
    for block in (*BLOCKS, "default"):
        for k in DATASET_KEYS:
            note = notes[k] if block != "default" else f"a default for each dataset's {k}, used where a dataset " \
                                                       f"names none: {notes[k]}"
            rules[f"data.{block}.{k}"] = Derive(partial(_data_leaf, f"data.{block}.{k}"), note)
        rules[f"data.{block}.*"] = Derive(partial(_data_leaf, f"data.{block}.*"),
                                          "an option of a dataset block (checked with the block)")
    for block in BLOCKS:
        rules[f"data.{block}"] = Derive(partial(_data_leaf, f"data.{block}"),
                                        f"null: no data.{block} set" + (" (validation, if any, is on the rows "
                                        "data.train's split_validation_size holds out)" if block == "validation"
                                        else "") + "; or a list of exactly one dataset")
    return rules


def _max_input(value: Any, src: Source) -> list[tuple[Path, Any]]:
    total = src.get("policy.max_total_sequence_length")
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise TranslationError("data.max_input_seq_length", f"expected an integer >= 2, got {value!r}")
    if isinstance(total, int) and value >= total:
        return []
    return [("data.max_input_seq_length", value - 1)]


def _add_system_prompt(value: Any, src: Source) -> list[tuple[Path, Any]]:
    """Older NeMo-RL recipes' ``data.add_system_prompt``: whether prompts get a system turn. Inflight gives one
    exactly when ``data.system_prompt_file`` is set, so ``false`` means no system prompt file."""
    if not isinstance(value, bool):
        raise TranslationError("data.add_system_prompt", f"expected true or false, got {value!r}")
    return [] if value else [("data.system_prompt_file", None)]


ENV_NAMES = ("math", "math_default", "math_multi_reward", "code", "code_jaccard", "reward_model", "vlm", "nemo_gym",
             "clevr-cogent", "geometry3k", "refcoco")
"""NeMo-RL's registered environments (``ENV_REGISTRY``) and its VLM task names, which its recipes name as
``env.<name>``; another section name is checked by the ``env.*`` rule."""
ENV_KEYS = ("num_workers", "math_verify_impl", "stop_strings", "verifier_type", "reward_functions", "timeout_s")
"""NeMo-RL's math environment options, and Inflight's own ``reward_functions`` / ``timeout_s`` (NeMo-RL's math
environment reads no ``reward_functions``, so one given for it, e.g. as an override, is Inflight's)."""


def _env_leaf(name: str, key: str, value: Any, src: Source) -> list[tuple[Path, Any]]:
    if name not in resolve(src).envs:
        return []
    path = f"env.{name}.{key}"
    if name in VLM_ENVS and key in ("num_workers", "reward_functions"):
        return [(path, value if key == "num_workers" else vlm_rewards(path, value))]
    if name not in ("math", "math_default"):
        raise TranslationError(path, f"env.{name} scores the data, but Inflight's env sections score as NeMo-RL's "
                                     f"math environment{' (num_workers, reward_functions)' if name in VLM_ENVS else ''}"
                                     f" and its vision-language one only (expected data env_name 'math' or "
                                     f"'clevr-cogent')")
    if key in ("num_workers", "reward_functions", "timeout_s"):
        return [(path, value)]
    if key == "math_verify_impl":
        if value not in MATH_VERIFY_IMPLS:
            raise TranslationError(path, f"{value!r}: expected one of {', '.join(MATH_VERIFY_IMPLS)}")
        return [(path, value)]
    if key == "verifier_type" and value in (None, "math"):
        return []
    if key == "stop_strings" and value is None:
        return []
    raise TranslationError(path, f"{value!r}: not supported for the math environment (expected "
                                 f"{'null' if key == 'stop_strings' else 'null or math'})")


SCRIPT_ENVS = {"sliding_puzzle_game": "NeMo-RL's sliding-puzzle game (SlidingPuzzleEnv), which its own script "
                                       "examples/run_grpo_sliding_puzzle.py builds together with the puzzles it "
                                       "generates (no dataset names it)"}
"""``env.<name>`` sections that a NeMo-RL example script plays with data it generates itself: the recipe is not a
dataset's, and Inflight has neither the environment nor the data."""


def _env_other(value: Any, src: Source) -> list[tuple[Path, Any]]:
    """A section or key the generated rules do not name: an error if the data uses it or a NeMo-RL script plays it
    (:data:`SCRIPT_ENVS`), else ignored."""
    used = resolve(src).envs
    for name in src.get("env") or {}:
        if name in SCRIPT_ENVS:
            raise TranslationError(f"env.{name}", f"{SCRIPT_ENVS[name]}: Inflight has no such environment; write "
                                                  f"the game as env.<name>.environment with its puzzles as data "
                                                  f"(docs/environments.md)")
    for name, section in (src.get("env") or {}).items():
        if name not in used:
            continue
        if name not in ENV_NAMES:
            raise TranslationError(f"env.{name}", "an environment NeMo-RL does not register; Inflight scores as "
                                                  "NeMo-RL's math environment only (expected env.math)")
        extra = sorted(set(section or {}) - set(ENV_KEYS))
        if extra:
            raise TranslationError(f"env.{name}.{extra[0]}", f"not an option of NeMo-RL's math environment here "
                                                             f"(expected one of {', '.join(ENV_KEYS)})")
    return []


def _env_rules() -> dict[Path, Rule]:
    unused = "an env section no dataset names (data env_name): NeMo-RL's run_grpo.py does not create it either"
    rules: dict[Path, Rule] = {"env.*": Derive(_env_other, unused)}
    for name in ENV_NAMES:
        for key in ENV_KEYS:
            rules[f"env.{name}.{key}"] = Derive(partial(_env_leaf, name, key), unused)
        rules[f"env.{name}.*"] = Derive(_env_other, unused)
    return rules


def _nemo_rl_only(rules: dict[Path, Rule]) -> dict[Path, Rule]:
    """Each rule applies to a NeMo-RL recipe only; in Inflight's own recipes (which go through the same table)
    the key passes through as it is."""
    return {path: When(nemo_rl, rule, None, "in a NeMo-RL recipe") for path, rule in rules.items()}


DATA_RULES: dict[Path, Rule] = _nemo_rl_only({
    **_data_rules(),
    "data.max_input_seq_length": Derive(
        _max_input, "NeMo-RL masks a prompt of max_input_seq_length tokens or more (it is generated, not trained); "
                    "Inflight drops a prompt of more than data.max_input_seq_length (and draws another), so the bound "
                    "is the value - 1; at or above policy.max_total_sequence_length (NeMo-RL's default: only an "
                    "upper bound) Inflight's default applies: the room left after policy.generation.max_new_tokens, "
                    "or the context - 1 when the answer budget is the whole context"),
    "data.num_workers": Ignore("NeMo-RL's DataLoader worker processes; Inflight reads rows memory-mapped and "
                               "tokenizes each one when it is drawn, in the job's process"),
    "data.use_multiple_dataloader": NeutralOnly((False,), "one dataloader per dataset: Inflight trains on one set"),
    "data.add_system_prompt": Derive(_add_system_prompt, "true: a system turn from data.system_prompt_file when it "
                                                         "is set, as Inflight always does"),
    **_env_rules(),
})
"""Rules for NeMo-RL's ``data.*`` and ``env.*`` keys."""
SAME_MEANING = ("data.shuffle",)
"""NeMo-RL ``data`` keys with no rule: Inflight's key of the same name and meaning (shuffle the training rows each
epoch, seeded by ``grpo.seed``)."""
