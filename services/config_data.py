"""Typed configuration of the data a run trains and validates on (``data``) and of how answers are scored
(``env``, with its named reward environments ``env.<name>``). Names follow NeMo-RL where the concept is the
same; docs/configuration.md lists each key with its NeMo-RL counterpart."""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from protocol.config_base import ConfigModel

BUILTIN_DATASETS = ("repeat_letter", "arithmetic")
"""Prompt sets generated in process from ``grpo.seed`` (:mod:`rollout.tasks`)."""


class DataConfig(ConfigModel):
    """``data``: the training and validation rows and how a row becomes a prompt."""

    dataset_name: Literal["repeat_letter", "arithmetic"] | None = None
    """A built-in prompt set generated from ``grpo.seed`` (``repeat_letter``: the toy task; ``arithmetic``:
    "What is a plus b?"). Used when ``train_data_path`` is not set; default ``repeat_letter``."""
    num_prompts: int = Field(default=4096, ge=1)
    """Size of a built-in prompt set (``dataset_name``)."""
    train_data_path: str | None = None
    """Training rows: a JSONL, Parquet or CSV file (or a glob of them), or a directory written by
    ``datasets.Dataset.save_to_disk``; read with Hugging Face ``datasets`` (memory-mapped Arrow)."""
    val_data_path: str | None = None
    """Validation rows, in the same forms as ``train_data_path``. With a built-in ``dataset_name`` and no path,
    validation uses ``max_val_samples`` prompts of the same set drawn with another seed."""
    input_key: str = Field(default="input", min_length=1)
    """Column holding the prompt text (ignored for rows that have a ``messages`` column of chat turns)."""
    output_key: str = Field(default="output", min_length=1)
    """Column holding the reference answer; it reaches the reward function as ``task["answer"]``."""
    messages_key: str = Field(default="messages", min_length=1)
    """Column holding chat turns (a list of ``{role, content}``); when present it is the prompt."""
    prompt_file: str | None = None
    """A text file with one ``{}`` that the prompt text is put into (NeMo-RL ``data.prompt_file``)."""
    system_prompt_file: str | None = None
    """A text file whose content becomes the system turn of every prompt."""
    max_input_seq_length: int | None = Field(default=None, ge=1)
    """Prompts longer than this many tokens (after the chat template) are dropped and counted, never
    truncated; default: ``policy.max_total_sequence_length - policy.generation.max_new_tokens``."""
    shuffle: bool = True
    """Shuffle the training rows each epoch (seeded by ``grpo.seed`` and the epoch)."""
    skip_invalid_rows: bool = False
    """Skip and count rows with a missing key, a wrong type or an empty prompt; False: the first one is an error
    naming the file, row and key."""
    env_name: str | None = None
    """Which ``env.<name>`` section scores these rows; default: the only named section if there is exactly one,
    else ``env.reward_fn``."""


def check_reward_name(key: str, name: str) -> None:
    """A reward function name is a registered one or ``module:function`` / ``file.py:function``."""
    from rollout.rewards import REWARD_FNS

    if name not in REWARD_FNS and ":" not in name:
        raise ValueError(f"{key}: expected one of {sorted(REWARD_FNS)} or 'module:function' / "
                         f"'file.py:function', got {name!r}")


class RewardFunctionSpec(ConfigModel):
    """One entry of ``env.<name>.reward_functions``."""

    name: str = Field(min_length=1, max_length=512)
    """A registered reward function (``math_verify``, ``math_exact``, ``format``, ``repeat_letter``) or your own as
    ``package.module:function`` / ``/path/to/file.py:function``."""
    weight: float = Field(default=1.0, gt=0.0, le=1000.0)
    """Weight of this function in the sample's reward (the weighted sum of every function's value)."""

    @model_validator(mode="after")
    def _known_name(self):
        check_reward_name("name", self.name)
        return self


class RewardEnvConfig(ConfigModel):
    """``env.<name>``: a named reward environment (NeMo-RL ``env.math``, ``env.clevr-cogent``...)."""

    reward_functions: list[RewardFunctionSpec] = Field(
        default_factory=lambda: [RewardFunctionSpec(name="math_verify", weight=1.0)], min_length=1)
    """Reward functions and their weights; the reward is the weighted sum, and each function's mean is a metric
    (``reward_<name>_mean``). Default: ``math_verify`` alone."""
    num_workers: int = Field(default=2, ge=1, le=256)
    """Worker processes per engine that run the reward functions; a call that overruns ``timeout_s`` has its worker
    killed (and replaced) and its sample fails with the reason."""
    timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    """Deadline for scoring one sample with one reward function."""
    math_verify_impl: Literal["hf_math_verify"] = "hf_math_verify"
    """NeMo-RL's key; Inflight's ``math_verify`` is Hugging Face Math-Verify."""

    @model_validator(mode="after")
    def _names(self):
        names = [f.name for f in self.reward_functions]
        if len(set(names)) != len(names):
            raise ValueError(f"reward_functions: each function at most once, got {names}")
        return self


class EnvConfig(ConfigModel):
    """``env``: how answers are scored. ``reward_fn`` is one function; a named section ``env.<name>``
    (:class:`RewardEnvConfig`) gives several weighted functions run in worker processes."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, RewardEnvConfig] = Field(init=False)  # pyright: ignore[reportIncompatibleVariableOverride]

    reward_fn: str = Field(default="repeat_letter", min_length=1, max_length=512)
    """Reward function: ``repeat_letter``, ``math_exact``, ``format``, or your own as
    ``package.module:function`` / ``/path/to/file.py:function`` (importable where the engines run)."""
    reward_timeout_s: float = Field(default=30.0, gt=0.0)
    """Deadline for scoring one group; a hung reward function fails its samples, never scores them 0."""

    @property
    def named(self) -> dict[str, RewardEnvConfig]:
        """The named sections ``env.<name>``."""
        return dict(self.__pydantic_extra__ or {})

    @model_validator(mode="after")
    def _reward_name(self):
        check_reward_name("reward_fn", self.reward_fn)
        return self
