"""Typed configuration of the data a run trains and validates on (``data``) and of how answers are scored
(``env``, with its named reward environments ``env.<name>``). Names follow NeMo-RL where the concept is the
same; docs/configuration.md lists each key with its NeMo-RL counterpart."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from protocol.config_base import ConfigModel

BUILTIN_DATASETS = ("repeat_letter", "arithmetic")
"""Prompt sets generated in process from ``grpo.seed`` (:mod:`services.data.tasks`)."""
HUB_PREFIX = "hf://"
"""A data path ``hf://<owner>/<name>`` names a Hugging Face Hub dataset."""
MATH_VERIFY_IMPLS = {"hf_math_verify": "math_verify", "dapo_math_verify": "dapo_math_verify"}
"""``env.<name>.math_verify_impl`` -> the reward function that the name ``math_verify`` stands for."""


class DataConfig(ConfigModel):
    """``data``: the training and validation rows and how a row becomes a prompt."""

    dataset_name: Literal["repeat_letter", "arithmetic", "letter_relay", "multi_step_arithmetic"] | None = None
    """A built-in prompt set generated from ``grpo.seed`` (``repeat_letter``: the toy task; ``arithmetic``:
    "What is a plus b?"). Used when ``train_data_path`` is not set; default ``repeat_letter``."""
    num_prompts: int = Field(default=4096, ge=1)
    """Size of a built-in prompt set (``dataset_name``)."""
    train_data_path: str | None = None
    """Training rows: a JSONL, Parquet or CSV file (or a glob of them), a directory written by
    ``datasets.Dataset.save_to_disk``, or a Hugging Face Hub dataset ``hf://<owner>/<name>`` (loaded with
    ``datasets.load_dataset`` when the run starts: it needs the Hub or a copy in the datasets cache); read with
    Hugging Face ``datasets`` (memory-mapped Arrow)."""
    train_split: str | None = None
    """Split of an ``hf://`` ``train_data_path`` (default ``train``); only for ``hf://`` paths (NeMo-RL
    ``data.train.split``)."""
    val_data_path: str | None = None
    """Validation rows, in the same forms as ``train_data_path``. With a built-in ``dataset_name`` and no path,
    validation uses ``max_val_samples`` prompts of the same set drawn with another seed."""
    val_split: str | None = None
    """Split of an ``hf://`` ``val_data_path`` (default ``train``); only for ``hf://`` paths (NeMo-RL
    ``data.validation.split``)."""
    split_validation_size: float = Field(default=0.0, ge=0.0)
    """Hold out part of ``train_data_path`` as the validation set (when no ``val_data_path`` is given): a
    fraction in (0, 1) (``ceil(size x rows)`` rows) or a whole number of rows >= 1; 0: no hold-out. The rows are
    a seeded permutation's first ones (``split_validation_seed``), the same rows as NeMo-RL's
    ``train_test_split``; they never enter training."""
    split_validation_seed: int | None = Field(default=None, ge=0)
    """Seed of the ``split_validation_size`` hold-out; default ``grpo.seed`` (NeMo-RL ``data.train.seed``)."""
    input_key: str = Field(default="input", min_length=1)
    """Column holding the prompt text (ignored for rows that have a ``messages`` column of chat turns). A dotted
    path reads into nested columns when no column has that exact name: ``prompt.0.content`` is
    ``row["prompt"][0]["content"]``."""
    output_key: str = Field(default="output", min_length=1)
    """Column holding the reference answer; it reaches the reward function as ``task["answer"]``. A dotted path
    reads into nested columns, as for ``input_key`` (``reward_model.ground_truth``)."""
    task_columns: list[str] | None = None
    """The other columns that reach the reward function as task metadata; None: every column but the prompt's
    and the answer's; ``[]``: none (a large column that the reward does not read stays out of the wire)."""
    messages_key: str = Field(default="messages", min_length=1)
    """Column holding chat turns (a list of ``{role, content}``); when present it is the prompt."""
    prompt_file: str | None = None
    """A text file with one ``{}`` that the prompt text is put into (NeMo-RL ``data.prompt_file``)."""
    system_prompt_file: str | None = None
    """A text file whose content becomes the system turn of every prompt."""
    max_input_seq_length: int | None = Field(default=None, ge=1)
    """Prompts longer than this many tokens (after the chat template) are dropped and counted, never
    truncated; must be < ``policy.max_total_sequence_length``. Default: ``policy.max_total_sequence_length -
    policy.generation.max_new_tokens`` (``max_total_sequence_length - 1`` when that is 0). An answer gets
    ``min(max_new_tokens, max_total_sequence_length - prompt length)`` tokens, as in NeMo-RL."""
    shuffle: bool = True
    """Shuffle the training rows each epoch (seeded by ``grpo.seed`` and the epoch)."""
    skip_invalid_rows: bool = False
    """Skip and count rows with a missing key, a wrong type or an empty prompt; False: the first one is an error
    naming the file, row and key."""
    env_name: str | None = None
    """Which ``env.<name>`` section scores these rows; default: the only named section if there is exactly one,
    else ``env.reward_fn``."""
    image_key: str | None = Field(default=None, min_length=1)
    """Column holding a row's image (or a list of images) for a vision-language model: a file path (a relative
    one is read against the data file's directory), a ``data:image/...;base64,`` URI, the encoded bytes, or a
    ``{bytes, path}`` mapping (a ``datasets.Image`` column); None: text rows. The model must be a Qwen2-VL-family
    vision-language model; images are prepared in ``data.image_workers`` processes and a prompt carries its resized
    pixels to the engine once (docs/multimodal.md). Inflight's key; NeMo-RL's VLM processors read their datasets'
    own columns."""
    image_workers: int = Field(default=8, ge=1, le=64)
    """Worker processes that prepare images (decode, validate, resize and patchify by the model's image processor
    rules; ``services/data/image_pool.py``); 8 is the seed's cap. Inflight's key."""
    image_timeout_s: float = Field(default=30.0, gt=0.0, le=3600.0)
    """Deadline for preparing one image; past it its worker is killed and the image fails, counted."""
    max_image_bytes: int = Field(default=32 * 2**20, ge=1, le=2**31)
    """Largest encoded image accepted (bytes); a larger one fails, counted."""
    max_image_pixels: int = Field(default=8192 * 8192, ge=1, le=2**31)
    """Largest image accepted, width x height, read from its header before decoding; a larger one fails,
    counted (the processor then shrinks accepted images to its own ``max_pixels``)."""
    image_roots: list[str] = Field(default_factory=list)
    """Directories an image path may point into besides the data's own directory tree (the data file's
    directory, or the ``save_to_disk`` directory); a path whose real path (symlinks resolved) is elsewhere fails,
    counted (``outside_root``). Inflight's key (docs/security.md)."""

    def row_images(self, row: dict) -> list[str | bytes | Mapping[str, object]]:
        """The image references of ``row`` (``image_key``'s value: one, or a list; each an
        :data:`services.data.image_refs.ImageRef`); [] for text rows or an empty cell. The data wing's
        :meth:`services.data.image_pool.ImagePool.for_data` prepares them."""
        value = row.get(self.image_key) if self.image_key is not None else None
        return [] if value is None else list(value) if isinstance(value, list) else [value]

    @model_validator(mode="after")
    def _hub_and_split(self):
        for split_key, path_key in (("train_split", "train_data_path"), ("val_split", "val_data_path")):
            path = getattr(self, path_key)
            if getattr(self, split_key) is not None and not (path or "").startswith(HUB_PREFIX):
                raise ValueError(f"{split_key}: only for a Hugging Face Hub {path_key} ({HUB_PREFIX}<owner>/<name>), "
                                 f"got {path_key}={path!r}")
            if path is not None and path.startswith(HUB_PREFIX):
                hub_id(path, path_key)
        size = self.split_validation_size
        if size >= 1 and not float(size).is_integer():
            raise ValueError(f"split_validation_size ({size}): expected a fraction in (0, 1) or a whole number of "
                             f"rows")
        return self


def hub_id(path: str, key: str = "data.train_data_path") -> str:
    """The Hub repository id of an ``hf://<owner>/<name>`` path; ``ValueError`` naming ``key`` otherwise."""
    repo = path[len(HUB_PREFIX):]
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"{key} ({path!r}): expected {HUB_PREFIX}<owner>/<name>, a Hugging Face Hub dataset id")
    return repo


def check_reward_name(key: str, name: str) -> None:
    """A reward function name is a registered one or ``module:function`` / ``file.py:function``."""
    from rollout.rewards.registry import REWARD_FNS

    if name not in REWARD_FNS and ":" not in name:
        raise ValueError(f"{key}: expected one of {sorted(REWARD_FNS)} or 'module:function' / "
                         f"'file.py:function', got {name!r}")


class RewardFunctionSpec(ConfigModel):
    """One entry of ``env.<name>.reward_functions``."""

    name: str = Field(min_length=1, max_length=512)
    """A registered reward function (``math_verify``, ``dapo_math_verify``, ``math_exact``, ``format``,
    ``repeat_letter``) or your own as ``package.module:function`` / ``/path/to/file.py:function``."""
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
    (``reward_<name>_mean``: a registered name, or your function's name, ``_2``... when two collide). Default:
    ``math_verify`` alone."""
    num_workers: int = Field(default=2, ge=1, le=256)
    """Worker processes per engine that run the reward functions; a call that overruns ``timeout_s`` has its worker
    killed (and replaced) and its sample fails with the reason."""
    timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    """Deadline for scoring one sample with one reward function."""
    environment: str | None = Field(default=None, min_length=1, max_length=512)
    """The environment that plays each episode (docs/environments.md): ``tool_calls`` (runs ``tools``; a turn
    without a call is the final answer, scored by ``reward_functions``), ``letter_relay`` (the example game), or
    your own class as ``package.module:Class`` / ``/path/to/file.py:Class``. None: one sampled answer per
    prompt, scored by ``reward_functions`` (unless ``url`` is set)."""
    environment_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment class's constructor (plain values)."""
    url: str | None = Field(default=None, min_length=1, max_length=2048)
    """An environment server (``POST /reset``, ``POST /step``; docs/environments.md, "Environment servers") that
    plays the episodes instead of a class in the engine's process."""
    agent: str | None = Field(default=None, min_length=1, max_length=2048)
    """An agent that plays each episode through the pool's OpenAI endpoint (docs/agents.md): your coroutine
    ``async def run(task, client) -> reward`` as ``package.module:function`` / ``/path/to/file.py:function``
    (``client``: an ``openai.AsyncOpenAI`` bound to the sample's rollout session), or the ``http(s)://`` URL of an
    agent server (``POST <url>/run``, NeMo-Gym's shape). Its calls are captured token for token; it gives the
    reward. Needs ``policy.generation.vllm_cfg.expose_http_server``; excludes ``environment``, ``url`` and
    ``serve``; ``reward_functions`` are not used."""
    agent_timeout_s: float = Field(default=600.0, gt=0.0, le=86400.0)
    """Deadline of one agent episode (every call it makes included; an agent server's whole ``/run``, per
    attempt); past it the sample fails with the reason."""
    agent_base_url: str | None = Field(default=None, min_length=1, max_length=2048)
    """The pool's URL as the agent reaches it (``http://host:port[/route_prefix]``); default: the Serve proxy on
    the engine's own node. Set it when an agent server runs on another machine."""
    serve: bool = False
    """Deploy ``environment`` as a Ray Serve application next to the pool (its own replicas and HTTP route);
    the engines then call it as they call a ``url``."""
    serve_replicas: int = Field(default=1, ge=1, le=256)
    """Replicas of the served environment (``serve``)."""
    tools: list[Literal["calculator"]] = Field(default_factory=list)
    """Tools the model is shown in the prompt (the chat template's ``tools``), run by ``tool_calls`` (or by the
    server at ``url``)."""
    max_tool_calls: int = Field(default=8, ge=1, le=1024)
    """Tool calls per episode of ``tool_calls``; a turn that would pass it is scored as the final answer."""
    step_timeout_s: float = Field(default=30.0, gt=0.0, le=3600.0)
    """Deadline of one ``reset`` or ``step`` call (an HTTP call's own deadline for a server); past it the sample
    fails with the reason, never scores 0."""
    max_concurrent_calls: int = Field(default=64, ge=1, le=65536)
    """Calls one engine has open to an environment server at once (the others wait their turn)."""
    max_retries: int = Field(default=2, ge=0, le=10)
    """Retries of a server call that timed out, could not connect or got an HTTP 5xx (not a 4xx or a malformed
    answer)."""
    retry_backoff_s: float = Field(default=0.5, ge=0.0, le=60.0)
    """First back-off between retries; it doubles with each retry (with jitter)."""
    truncated_reward: float | None = Field(default=0.0, ge=-1e6, le=1e6)
    """Reward of an episode cut by ``grpo.max_rollout_turns`` or the context before the environment ended it
    (finish reason ``length``, counted); None: such a sample fails instead."""
    math_verify_impl: Literal["hf_math_verify", "dapo_math_verify"] = "hf_math_verify"
    """What ``math_verify`` in ``reward_functions`` is (NeMo-RL's key): ``hf_math_verify``, Hugging Face
    Math-Verify; ``dapo_math_verify``, DAPO's answer check (the last ``Answer: ...`` line, normalised, equals the
    normalised reference), i.e. the entry becomes ``dapo_math_verify``."""

    @property
    def episodic(self) -> bool:
        """Whether an environment (a class, a server or a served class) plays the episodes."""
        return self.environment is not None or self.url is not None

    @model_validator(mode="after")
    def _agent(self):
        if self.agent is None:
            return self
        if self.environment is not None or self.url is not None or self.serve:
            raise ValueError("agent: an agent plays the episodes itself; it excludes environment, url and serve")
        if self.tools:
            raise ValueError(f"tools: {self.tools} are run by environment: tool_calls; an agent brings its own tools")
        if self.agent_base_url is not None and not self.agent_base_url.startswith(("http://", "https://")):
            raise ValueError(f"agent_base_url: expected http://host:port..., got {self.agent_base_url!r}")
        if not self.agent.startswith(("http://", "https://")) and ":" not in self.agent:
            raise ValueError(f"agent: expected 'package.module:function', '/path/to/file.py:function' or an agent "
                             f"server's http(s):// URL, got {self.agent!r}")
        return self

    @model_validator(mode="after")
    def _environment(self):
        if self.url is not None and (self.serve or self.environment is not None):
            raise ValueError("url: an environment server given by URL excludes environment and serve (set one)")
        if self.serve and self.environment is None:
            raise ValueError("serve: true needs environment (the class to deploy)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http:// or https://..., got {self.url!r}")
        if self.tools and self.environment != "tool_calls" and self.url is None:
            raise ValueError(f"tools: {self.tools} are shown in the prompt and run by environment: tool_calls or a "
                             f"server at url, got environment {self.environment!r}")
        if self.serve and self.environment == "tool_calls":
            raise ValueError("serve: a tool_calls environment runs in the engines (serve: false); serve your own "
                             "environment class")
        if self.environment == "tool_calls" and not self.tools:
            raise ValueError("environment: tool_calls needs at least one of tools (e.g. [calculator])")
        return self

    @model_validator(mode="after")
    def _names(self):
        impl = MATH_VERIFY_IMPLS[self.math_verify_impl]
        if impl != "math_verify" and any(f.name == "math_verify" for f in self.reward_functions):
            self.reward_functions = [f.model_copy(update={"name": impl}) if f.name == "math_verify" else f
                                     for f in self.reward_functions]
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
