"""The recipe: one typed model per concern, loaded from YAML.

A recipe file is read by :mod:`services.recipe.files` (``defaults:`` chains,
``_override_``, command-line ``key.path=value`` overrides, ``${...}``
interpolation and NeMo-RL's resolvers), translated key by key by
:mod:`services.recipe.nemo_rl` (a NeMo-RL recipe's keys become Inflight's or are
listed as ignored with the reason; an Inflight recipe's keys pass as they are),
then validated here. Every error — unreadable YAML, unknown key (with a "did
you mean"), wrong type, out of bounds, contradictory settings, a NeMo-RL
setting Inflight cannot honour — becomes a :class:`RecipeError` naming the key.
"""
from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from learner.config import LossConfig, MegatronConfig, PolicyStepKeys, SequencePackingConfig
from protocol.config_base import ConfigModel
from rollout.config import GenerationConfig
from services.recipe.checkpointing import CheckpointingConfig
from services.recipe.data import DataConfig, EnvConfig, RewardEnvConfig
from services.recipe.files import RecipeError, read_recipe
from services.recipe.gpu_layout import check_gpu_layout
from services.recipe.grpo import GrpoConfig
from services.recipe.logger import LoggerConfig
from services.recipe.paths import resolve_paths
from services.recipe.rules import check_recipe

if TYPE_CHECKING:
    from services.recipe.nemo_rl.rules import TranslationReport

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
__all__ = ["RECIPES_DIR", "Recipe", "RecipeError", "load_recipe", "load_recipe_with_report", "recipe_to_yaml"]


CHAT_TEMPLATE_ARGUMENTS = ("conversation", "tools", "tokenize", "add_generation_prompt", "return_dict",
                           "continue_final_message", "chat_template")
"""``apply_chat_template`` arguments Inflight sets on every call; ``chat_template_kwargs`` may not name them."""


class TokenizerConfig(ConfigModel):
    """``policy.tokenizer`` (NeMo-RL's section; its other keys are translated by :mod:`services.recipe.nemo_rl`)."""

    name: str | None = None
    """A tokenizer directory other than ``policy.model_name``'s (NeMo-RL's key and meaning): its tokenizer files
    replace the model's for the learner, the engines, the prompts and exports (:mod:`services.models.variant`).
    None or the model's directory: the model's own tokenizer."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra arguments of every chat-template call (NeMo-RL's key and meaning), e.g. ``{enable_thinking: false}``:
    prompts, environment turns, validation, the parity probe, ``eval`` and ``generate``. {}: none."""

    @model_validator(mode="after")
    def _own_arguments(self):
        taken = sorted(set(self.chat_template_kwargs) & set(CHAT_TEMPLATE_ARGUMENTS))
        if taken:
            raise ValueError(f"chat_template_kwargs: {taken} are set by Inflight itself (it renders prompts with "
                             f"{', '.join(CHAT_TEMPLATE_ARGUMENTS)}); give only the template's own variables")
        return self


class PolicyConfig(PolicyStepKeys):
    """``policy``: the model, its learner and its generation (``train_global_batch_size`` is inherited from
    :class:`learner.config.PolicyStepKeys`)."""

    model_name: str = "tiny://qwen2"
    """HF model directory, or ``tiny://ARCH[?seed=N&size=S&tie=1]`` to build a random tiny model locally (ARCH:
    qwen2, qwen3, llama, llama3, qwen3_moe, mistral; tie=1 ties the embeddings, as Qwen2.5-0.5B/1.5B)."""
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    """The tokenizer, when it is not the model's."""
    hf_config_overrides: dict[str, Any] = Field(default_factory=dict)
    """Values set on top-level keys of the model's ``config.json`` before the learner and the engines read it
    (NeMo-RL's key and meaning), e.g. ``{max_position_embeddings: 65536}``; {}: the model's config as it is."""
    max_total_sequence_length: int = Field(default=8192, ge=16)
    """Prompt + answer tokens of one sequence."""
    freeze_vision_tower: bool = True
    """Keep a vision-language model's vision tower (every ``visual.*`` weight, the patch merger included) fixed:
    no gradient, no optimizer state, eval mode; only the language model trains, as in NeMo-RL's VLM recipes.
    ``false`` trains the tower with the language model. No effect on a text-only model."""
    refit_bucket_mb: int = Field(default=512, ge=1, le=65536)
    """Size of one weight bucket pushed to the engines, in MiB."""
    refit_transport: Literal["object_store", "collective", "cuda_ipc"] = "object_store"
    """How weights reach the engines after a step. ``object_store``: rank 0 exports CRC32-checked buckets
    to host memory, the pool keeps them and each engine installs them from ``/dev/shm`` (works everywhere;
    a restarted engine gets the latest version from the pool). ``collective``: rank 0 broadcasts buckets
    from its device to every engine worker over one NCCL group (gloo on CPU), received in the vLLM workers
    while they keep generating and checked on the device; a restarted engine rejoins at the next push.
    Needs the learner and the engines on their own devices (not colocated). ``cuda_ipc``: for an engine on
    rank 0's GPU (colocated on one GPU): rank 0 packs device-checksummed buckets on its GPU and the engine
    maps them through CUDA IPC handles and installs straight from them (no host copy); where no single
    engine runs on that GPU alone (CPU, more GPUs or engines), each push goes through the object store."""
    refit_cuda_graph: bool = True
    """``cuda_ipc`` with a learner of one GPU (no vision tower): pack each push by replaying one CUDA graph,
    captured at the first push, instead of launching a few hundred kernels one by one (a 0.6B model's export:
    22 -> 6 ms on an H100). The graph's buckets stay allocated: one more copy of the weights in the learner's
    memory. ``false``: pack eagerly, buckets freed after each push."""
    refit_timeout_s: float = Field(default=600.0, gt=0.0, le=86400.0)
    """Deadline of one weight push, for fetching its buckets and again for installing them on the engines; a push
    that misses it is rejected as a whole (the old version keeps serving). Separate from the per-sample
    ``generation.request_timeout_s``, which may be far shorter than a reload."""
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    """Sampling and engines."""
    megatron_cfg: MegatronConfig = Field(default_factory=MegatronConfig)
    """Learner parallelism and optimizer."""
    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig)
    """Packing into micro-batches."""


class ClusterConfig(ConfigModel):
    """``cluster``: the hardware the recipe is written for."""

    num_nodes: int = Field(default=1, ge=1, le=4096)
    """Nodes."""
    gpus_per_node: int = Field(default=0, ge=0, le=16)
    """GPUs per node; 0 runs on CPU."""
    engine_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each rollout engine asks for besides its GPUs, which keeps engines on the nodes that
    offer them: e.g. ``{"rollout_node": 0.01}`` with ``ray start --resources='{"rollout_node": 1}'`` on those
    nodes. Not used by a colocated pool on GPUs (its placement group decides)."""
    learner_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each learner rank asks for besides its GPU (see ``engine_resources``)."""


class RolloutPoolConfig(ConfigModel):
    """``rollout_pool``: the long-lived generation service."""

    name: str = Field(default="inflight-pool", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """Ray Serve application name; learners attach to it by name."""
    num_engines: int = Field(default=1, ge=1, le=1024)
    """vLLM engine replicas."""
    http_host: str = "127.0.0.1"
    """Address of /healthz, /readyz, /metrics; loopback unless told otherwise."""
    http_port: int = Field(default=8123, ge=0, le=65535)
    """Port of the HTTP endpoints (0 picks a free one)."""
    route_prefix: str = Field(default="/", pattern=r"^/([A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*)?$")
    """Path under which the pool's HTTP endpoints answer on the cluster's one Serve proxy: ``/`` (the default),
    or ``/<path>`` (no trailing ``/``) so that several pools serve side by side on one cluster, each at its own
    prefix (``/<path>/metrics``, ``/<path>/v1/status``, the status page at ``/<path>/``)."""
    admin_token_env: str = "INFLIGHT_ADMIN_TOKEN"
    """Environment variable holding the bearer token for admin endpoints (pause, resume, drain)."""
    max_inflight_groups: int = Field(default=256, ge=1)
    """Backpressure: groups generated but not yet taken by the learner."""
    channel_send_timeout_s: float = Field(default=30.0, gt=0.0, le=3600.0)
    """Longest an engine waits for room in the learner's trajectory channel (full: the learner is not reading)
    before it gives the message up: counted in ``inflight_channel_send_failures``, its prompt reported to the
    learner as undelivered (dropped with a reason, replaced); the engine goes on serving. Must be
    < ``policy.generation.request_timeout_s``."""
    learner_gpus: int | None = Field(default=None, ge=0)
    """GPUs of the learner job when not colocated; default: the rest of the cluster."""
    share_gpu: bool = False
    """Async on one GPU: the pool's one engine and the learner's one rank share the cluster's one GPU, not
    colocated (the engine keeps its memory while the learner trains), each asking Ray for half of it. The memory
    is split explicitly: the engine takes ``policy.generation.vllm_cfg.gpu_memory_utilization`` of the GPU, the
    learner at most ``policy.megatron_cfg.gpu_memory_fraction``, together <= 0.95. Needs
    ``cluster.num_nodes = gpus_per_node = 1``, one engine, TP = PP = 1 and ``policy.refit_transport`` other
    than ``collective`` (docs/gpu.md, "Async on one GPU")."""


class Recipe(ConfigModel):
    """A whole run."""

    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    """Algorithm sizes and schedule."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    """Model, learner, generation."""
    loss_fn: LossConfig = Field(default_factory=LossConfig)
    """GRPO loss."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Training and validation data."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """Rewards."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Hardware."""
    rollout_pool: RolloutPoolConfig = Field(default_factory=RolloutPoolConfig)
    """Generation service."""
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    """Checkpoints."""
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    """Metrics."""

    @model_validator(mode="after")
    def _consistent(self):
        check_recipe(self)
        check_gpu_layout(self)
        return self

    @property
    def gpus_per_engine(self) -> int:
        """GPUs one vLLM engine takes: ``vllm_cfg.tensor_parallel_size x pipeline_parallel_size``."""
        v = self.policy.generation.vllm_cfg
        return v.tensor_parallel_size * v.pipeline_parallel_size

    @property
    def learner_gpus(self) -> int:
        c = self.cluster
        total = c.num_nodes * c.gpus_per_node
        if self.policy.generation.colocated.enabled:
            return total
        if self.rollout_pool.share_gpu and total:
            return 1  # one rank on the GPU the pool's engine holds the other half of
        if self.rollout_pool.learner_gpus is not None:
            return self.rollout_pool.learner_gpus
        return total - self.rollout_pool.num_engines * self.gpus_per_engine


# ---------------------------------------------------------------- loading

def _section(ann: Any) -> type[ConfigModel] | None:
    """The model a field holds (``X`` or ``X | None``), or None for a plain value."""
    for a in (ann, *typing.get_args(ann)):
        if isinstance(a, type) and issubclass(a, ConfigModel):
            return a
    return None


def is_recipe_key(path: str) -> bool:
    """Whether the dotted ``path`` is a key of the recipe schema (a field, a section, an ``env.<name>`` section or
    a key inside a mapping-valued field such as ``cluster.engine_resources``)."""
    model: type[ConfigModel] = Recipe
    parts = path.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None and model is EnvConfig:
            sub: type[ConfigModel] | None = RewardEnvConfig
        elif field is None:
            return model.model_config.get("extra") == "allow"  # e.g. vllm_kwargs: checked against vLLM later
        else:
            sub = _section(field.annotation)
            if sub is None:
                ann = field.annotation
                return i == len(parts) - 1 or dict in (typing.get_origin(a) for a in (ann, *typing.get_args(ann)))
        model = sub
    return True


def _model_at(path: tuple) -> type[ConfigModel] | None:
    model: Any = Recipe
    for p in path:
        if isinstance(p, int):
            continue
        field = getattr(model, "model_fields", {}).get(p)
        if field is None:
            return None
        ann = field.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, ConfigModel) else None
        if model is None:
            return None
    return model


REMOVED_KEYS = {
    "env.task": "the built-in prompt sets are data.dataset_name (repeat_letter, arithmetic)",
    "env.num_prompts": "the size of a built-in prompt set is data.num_prompts",
    "rollout_pool.gpus_per_engine": "an engine takes policy.generation.vllm_cfg.tensor_parallel_size x "
                                    "pipeline_parallel_size GPUs; set those instead",
}
"""Keys recipes used to accept, with what to write instead (shown when a recipe still names one).
``policy.train_micro_batch_size``, removed too, is NeMo-RL's: it is listed as ignored with the same hint
(:mod:`services.recipe.nemo_rl.table_policy`)."""


def _reject_removed(data: dict) -> None:
    """A removed key is an error with its replacement, before validation (``env`` accepts named sections, so
    ``env.task`` would otherwise read as a section)."""
    for key, hint in REMOVED_KEYS.items():
        node: Any = data
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            raise RecipeError(key, f"removed key: {hint}")


def _explain(err: ValidationError) -> RecipeError:
    e = err.errors()[0]
    loc = tuple(e["loc"])
    path = ".".join(str(p) for p in loc)
    if e["type"] == "extra_forbidden" and path in REMOVED_KEYS:
        return RecipeError(path, f"removed key: {REMOVED_KEYS[path]}")
    if e["type"] == "extra_forbidden":
        parent = _model_at(loc[:-1])
        known = list(parent.model_fields) if parent else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.5)
        hint = f"; did you mean '{'.'.join(str(p) for p in loc[:-1] + (close[0],))}'?" if close else ""
        return RecipeError(path, f"unknown key{hint} (known here: {', '.join(known)})")
    msg = e["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if loc:
        got = e.get("input")
        if not isinstance(got, dict):
            msg = f"{msg} (got {got!r})"
    return RecipeError(path, msg)


def load_recipe_with_report(path: str | os.PathLike | None = None, overrides: list[str] | None = None
                            ) -> tuple[Recipe, TranslationReport]:
    """Load a recipe file (default: ``recipes/tiny-cpu.yaml``) with ``overrides``; returns it and the report of
    what the translation kept, mapped and ignored (``report.summary()`` lists the ignored keys and why;
    ``report.resolved`` the relative paths found from the recipe's directory: :mod:`services.recipe.paths`)."""
    from services.recipe.nemo_rl.rules import TranslationError, translate
    from services.recipe.nemo_rl.table import TABLE

    recipe_file = Path(path) if path else RECIPES_DIR / "tiny-cpu.yaml"
    data = read_recipe(recipe_file, overrides)
    _reject_removed(data)
    try:
        translated, report = translate(data, TABLE, is_recipe_key)
    except TranslationError as err:
        raise RecipeError(err.path, err.reason) from None
    report.resolved = resolve_paths(translated, recipe_file)
    try:
        return Recipe.model_validate(translated), report
    except ValidationError as err:
        explained = _explain(err)
        sources = sorted({m.source for m in report.mapped if m.target == explained.path})
        if sources:
            raise RecipeError(explained.path, f"{explained.reason} (set from {', '.join(sources)})") from None
        raise explained from None


def load_recipe(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Recipe:
    """Load a recipe file (default: ``recipes/tiny-cpu.yaml``) and apply overrides."""
    return load_recipe_with_report(path, overrides)[0]


def recipe_to_yaml(recipe: Recipe) -> str:
    """The recipe as Inflight keys (every field, defaults included): what a run directory keeps as recipe.yaml."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
