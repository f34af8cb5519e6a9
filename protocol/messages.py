"""Wire message types.

Every message has a ``kind`` literal and converts to and from a plain map
(``to_wire`` / ``from_wire``); :mod:`protocol.codec` adds the schema version and
turns that map into msgpack bytes. ``from_wire`` is the single place where a
message arriving from another process is checked, field by field.

Per-token arrays travel as numpy arrays (int32 token ids and versions, float32
log-probs, uint8 loss mask) and come back as read-only views of the received buffer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from protocol import fields as F
from protocol.control import ControlMessage
from protocol.errors import ProtocolError
from protocol.images import PromptImage, image_ids_from_wire, images_from_wire
from protocol.loss_mask import read_turn_fields
from protocol.routing import group_schema, read_routed_experts

FINISH_REASONS = ("stop", "length", "abort", "error")
"""Why a sample ended: end-of-sequence/stop string, token limit, aborted
(deadline or shutdown), or failed (generation or reward error)."""
FAILURE_KINDS = ("generation", "environment", "reward", "length")
"""What failed a sample (``Trajectory.failure_kind``): sampling (retries exhausted, an engine error), the
environment (a failed reset or step, differing openings, messages that do not render), the reward function, or
room (no room for the prompt, an episode cut with no ``truncated_reward``)."""

MAX_GROUP_SIZE = 4096
MAX_TOKENS = 1 << 22
WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool")


def _i32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


_ALL_SAMPLED = np.ones(0, np.uint8)
"""Sentinel default of ``Trajectory.loss_mask``: every response token was sampled (single turn)."""


@dataclass
class Trajectory:
    """One sampled answer: its tokens, the engine's log-probs of them, the
    policy version that produced each token, and its reward.

    A multi-turn answer is its sampled turns and the environment's turns (tokenized once) laid end to end in
    ``response_ids``; ``loss_mask`` is 1 at tokens the engine sampled (trained) and 0 at environment tokens
    (context only, never trained); default all ones (one sampled turn). At environment tokens ``logprobs`` is
    0.0 and ``versions`` the version of the nearest sampled token before it (:mod:`protocol.loss_mask`);
    consumers still read them through the mask (:attr:`sampled_versions`). ``turn_finish_reasons``: one per
    sampled turn (default ``[finish_reason]``); ``finish_reason`` is the whole sample's.

    A sample that failed (generation error, reward error) has
    ``finish_reason == "error"``, ``reward is None``, ``error`` set (the reason) and
    ``failure_kind`` (one of :data:`FAILURE_KINDS`; on the wire only when set, optional
    key); it is never given reward 0.

    ``reward_components`` holds each reward function's value for this sample
    when the reward is a weighted sum of several (``env.<name>.reward_functions``);
    ``reward`` is then ``sum(weight * value)``. Empty for a single ``env.reward_fn``
    and for a failed sample; on the wire only when non-empty (optional key).
    """

    response_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float | None
    finish_reason: str = "stop"
    error: str = ""
    reward_components: dict[str, float] = field(default_factory=dict)
    loss_mask: np.ndarray = field(default_factory=lambda: _ALL_SAMPLED)
    turn_finish_reasons: list[str] = field(default_factory=list)
    failure_kind: str = ""
    routed_experts: np.ndarray | None = None
    """The experts the engine routed each position (prompt, then response) to, ``[P, MoE layers, top_k]``, for
    routing replay (:mod:`protocol.routing`); None: the learner routes itself. On the wire only when set."""

    def __post_init__(self):
        self.response_ids = _i32(self.response_ids)
        self.logprobs = _f32(self.logprobs)
        self.versions = _i32(self.versions)
        if self.loss_mask is _ALL_SAMPLED:
            self.loss_mask = np.ones(self.response_ids.shape[0], np.uint8)
        else:
            self.loss_mask = np.ascontiguousarray(self.loss_mask, dtype=np.uint8)
        if not self.turn_finish_reasons:
            self.turn_finish_reasons = [self.finish_reason]

    @property
    def ok(self) -> bool:
        return self.finish_reason != "error"

    @property
    def sampled(self) -> np.ndarray:
        """Boolean mask of the tokens the engine sampled (the trained ones)."""
        return self.loss_mask == 1

    @property
    def sampled_versions(self) -> np.ndarray:
        """The policy versions of the sampled tokens (environment tokens have none of their own)."""
        return self.versions[self.sampled]

    def to_wire(self) -> dict:
        d = {"response_ids": self.response_ids, "logprobs": self.logprobs,
             "versions": self.versions, "loss_mask": self.loss_mask, "reward": self.reward,
             "finish_reason": self.finish_reason, "turn_finish_reasons": list(self.turn_finish_reasons),
             "error": self.error}
        if self.reward_components:
            d["reward_components"] = {str(k): float(v) for k, v in self.reward_components.items()}
        if self.failure_kind:
            d["failure_kind"] = self.failure_kind
        if self.routed_experts is not None:
            d["routed_experts"] = self.routed_experts
        return d

    @classmethod
    def from_wire(cls, d: dict, path: str, vocab_size: int, schema: int = 2,
                  prompt_len: int = MAX_TOKENS) -> Trajectory:
        """Check and build one trajectory; ``schema`` 1 (before the loss mask): every token sampled, one turn,
        and the v2 keys must be absent; before 3 no ``routed_experts`` (at most ``prompt_len`` + n positions)."""
        d = F.as_dict(d, path)
        ids = F.as_array(F.req(d, "response_ids", path), f"{path}.response_ids", "int32")
        if ids.shape[0] > MAX_TOKENS:
            raise ProtocolError(f"{path}.response_ids", f"at most {MAX_TOKENS} tokens", ids.shape[0])
        n = ids.shape[0]
        lps = F.as_array(F.req(d, "logprobs", path), f"{path}.logprobs", "float32", length=n)
        vers = F.as_array(F.req(d, "versions", path), f"{path}.versions", "int32", length=n)
        F.check_token_ids(ids, f"{path}.response_ids", vocab_size)
        F.check_logprobs(lps, f"{path}.logprobs")
        F.check_non_negative(vers, f"{path}.versions")
        reason = F.as_str(F.req(d, "finish_reason", path), f"{path}.finish_reason")
        if reason not in FINISH_REASONS:
            raise ProtocolError(f"{path}.finish_reason", f"one of {FINISH_REASONS}", reason)
        error = F.as_str(F.req(d, "error", path), f"{path}.error")
        reward = F.req(d, "reward", path)
        if reason == "error":
            if reward is not None:
                raise ProtocolError(f"{path}.reward", "null for a failed sample", reward)
            if not error:
                raise ProtocolError(f"{path}.error", "a reason for a failed sample", error)
        else:
            reward = F.as_float(reward, f"{path}.reward")
        components = _reward_components(d.get("reward_components", {}), f"{path}.reward_components")
        if components and reason == "error":
            raise ProtocolError(f"{path}.reward_components", "empty for a failed sample", sorted(components))
        mask, turns = read_turn_fields(d, path, schema, reason, lps, vers, FINISH_REASONS)
        kind = F.as_str(d.get("failure_kind", ""), f"{path}.failure_kind")
        if kind and (kind not in FAILURE_KINDS or reason != "error"):
            raise ProtocolError(f"{path}.failure_kind", f"one of {FAILURE_KINDS}, for a failed sample only",
                                f"{kind!r} (finish_reason {reason!r})")
        routed = read_routed_experts(d, path, schema, prompt_len + n)
        return cls(ids, lps, vers, reward, reason, error, components, mask, turns, kind, routed)


MAX_REWARD_COMPONENTS = 64


def _reward_components(v: object, path: str) -> dict[str, float]:
    """An optional map of reward-function name -> finite value (absent in messages written before it)."""
    d = F.as_dict(v, path)
    if len(d) > MAX_REWARD_COMPONENTS:
        raise ProtocolError(path, f"at most {MAX_REWARD_COMPONENTS} reward functions", len(d))
    out: dict[str, float] = {}
    for name, value in d.items():
        key = F.as_str(name, f"{path}.<name>", max_chars=512, allow_empty=False)
        out[key] = F.as_float(value, f"{path}.{key}")
    return out


@dataclass
class TrajectoryGroup:
    """The G answers sampled for one prompt, scored, ready for the learner.

    ``scheduled_step`` is the learner step this group was generated for;
    the trajectory buffer uses it with the per-token ``versions`` to enforce
    ``max_trajectory_age_steps``.
    """

    KIND: ClassVar[str] = "trajectory_group"
    group_id: str
    prompt_id: str
    prompt_ids: np.ndarray
    trajectories: list[Trajectory]
    group_size: int
    vocab_size: int
    scheduled_step: int = 0
    engine_id: str = ""
    created_at: float = 0.0
    image_ids: tuple[str, ...] = ()
    """The sha256 names of the prompt's images, in prompt order (their pixels stay with the prompt)."""

    def __post_init__(self):
        self.prompt_ids = _i32(self.prompt_ids)
        self.image_ids = tuple(self.image_ids)

    @property
    def oldest_version(self) -> int:
        """Smallest policy version over the sampled tokens of the group's valid samples (environment tokens
        were produced by no policy)."""
        mins = [int(v.min()) for v in (t.sampled_versions for t in self.trajectories if t.ok) if v.size]
        return min(mins) if mins else 0

    @property
    def valid(self) -> list[Trajectory]:
        return [t for t in self.trajectories if t.ok]

    @property
    def schema(self) -> int:
        """The schema it is written at: 3 only when it carries routing (:func:`protocol.routing.group_schema`)."""
        return group_schema([t.routed_experts for t in self.trajectories])

    def to_wire(self) -> dict:
        return {"group_id": self.group_id, "prompt_id": self.prompt_id,
                "prompt_ids": self.prompt_ids,
                "trajectories": [t.to_wire() for t in self.trajectories],
                "group_size": self.group_size, "vocab_size": self.vocab_size,
                "scheduled_step": self.scheduled_step, "engine_id": self.engine_id,
                "created_at": self.created_at, "image_ids": list(self.image_ids)}

    @classmethod
    def from_wire(cls, d: dict, path: str = "", schema: int = 2) -> TrajectoryGroup:
        group_id = F.as_str(F.req(d, "group_id", path), F._join(path, "group_id"), allow_empty=False)
        prompt_id = F.as_str(F.req(d, "prompt_id", path), F._join(path, "prompt_id"), allow_empty=False)
        vocab = F.as_int(F.req(d, "vocab_size", path), F._join(path, "vocab_size"), 1, 1 << 24)
        gsize = F.as_int(F.req(d, "group_size", path), F._join(path, "group_size"), 1, MAX_GROUP_SIZE)
        p_ids = F.as_array(F.req(d, "prompt_ids", path), F._join(path, "prompt_ids"), "int32")
        if p_ids.shape[0] > MAX_TOKENS:
            raise ProtocolError(F._join(path, "prompt_ids"), f"at most {MAX_TOKENS} tokens", p_ids.shape[0])
        F.check_token_ids(p_ids, F._join(path, "prompt_ids"), vocab)
        raw = F.as_list(F.req(d, "trajectories", path), F._join(path, "trajectories"), MAX_GROUP_SIZE)
        if len(raw) != gsize:
            raise ProtocolError(F._join(path, "trajectories"), f"{gsize} trajectories (group_size)", len(raw))
        trajs = [Trajectory.from_wire(t, f"{F._join(path, 'trajectories')}[{i}]", vocab, schema, p_ids.shape[0])
                 for i, t in enumerate(raw)]
        step = F.as_int(F.req(d, "scheduled_step", path), F._join(path, "scheduled_step"), 0)
        engine_id = F.as_str(F.req(d, "engine_id", path), F._join(path, "engine_id"))
        created = F.as_float(F.req(d, "created_at", path), F._join(path, "created_at"))
        return cls(group_id, prompt_id, p_ids, trajs, gsize, vocab, step, engine_id, created,
                   image_ids_from_wire(d, path))


@dataclass
class PromptRequest:
    """A prompt to sample a group for. ``task`` carries what the reward
    function needs (e.g. the reference answer); values are strings or numbers.
    ``images``: a vision-language prompt's pictures, whose image tokens ``prompt_ids`` already holds."""

    KIND: ClassVar[str] = "prompt"
    prompt_id: str
    prompt_ids: np.ndarray
    task: dict = field(default_factory=dict)
    scheduled_step: int = 0
    images: list[PromptImage] = field(default_factory=list)

    def __post_init__(self):
        self.prompt_ids = _i32(self.prompt_ids)

    def to_wire(self) -> dict:
        return {"prompt_id": self.prompt_id, "prompt_ids": self.prompt_ids,
                "task": dict(self.task), "scheduled_step": self.scheduled_step,
                **({"images": [i.to_wire() for i in self.images]} if self.images else {})}

    @classmethod
    def from_wire(cls, d: dict, path: str = "") -> PromptRequest:
        pid = F.as_str(F.req(d, "prompt_id", path), F._join(path, "prompt_id"), allow_empty=False)
        ids = F.as_array(F.req(d, "prompt_ids", path), F._join(path, "prompt_ids"), "int32")
        F.check_non_negative(ids, F._join(path, "prompt_ids"))
        task = F.as_dict(F.req(d, "task", path), F._join(path, "task"))
        for k, v in task.items():
            if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                raise ProtocolError(f"{F._join(path, 'task')}.{k}", "a string or number", type(v).__name__)
            if isinstance(v, str):
                F.as_str(v, f"{F._join(path, 'task')}.{k}")
            elif isinstance(v, float):
                F.as_float(v, f"{F._join(path, 'task')}.{k}")  # NaN/inf: no reward fn wants them
        step = F.as_int(F.req(d, "scheduled_step", path), F._join(path, "scheduled_step"), 0)
        return cls(pid, ids, task, step, images_from_wire(d, path))


@dataclass
class TensorSpec:
    """Where one named tensor lies inside the buckets of a weight push."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int

    def to_wire(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "bucket": self.bucket, "offset": self.offset, "nbytes": self.nbytes}

    @classmethod
    def from_wire(cls, d: dict, path: str) -> TensorSpec:
        d = F.as_dict(d, path)
        name = F.as_str(F.req(d, "name", path), f"{path}.name", allow_empty=False)
        dtype = F.as_str(F.req(d, "dtype", path), f"{path}.dtype")
        if dtype not in WEIGHT_DTYPES:
            raise ProtocolError(f"{path}.dtype", f"one of {WEIGHT_DTYPES}", dtype)
        shape = tuple(F.as_int(s, f"{path}.shape[{i}]", 0, 1 << 40)
                      for i, s in enumerate(F.as_list(F.req(d, "shape", path), f"{path}.shape", 8)))
        bucket = F.as_int(F.req(d, "bucket", path), f"{path}.bucket", 0)
        offset = F.as_int(F.req(d, "offset", path), f"{path}.offset", 0)
        nbytes = F.as_int(F.req(d, "nbytes", path), f"{path}.nbytes", 0)
        # math.prod on Python ints: np.prod(dtype=int64) wraps silently, and a
        # shape like (2**32, 2**32) would then "need" 0 bytes and pass.
        expect = math.prod(shape) * dtype_itemsize(dtype)
        if nbytes != expect:
            raise ProtocolError(f"{path}.nbytes", f"{expect} (= prod(shape) x itemsize of {dtype})", nbytes)
        return cls(name, dtype, shape, bucket, offset, nbytes)


def dtype_itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


@dataclass
class WeightManifest:
    """Announces a weight push: the version it installs, every tensor's place
    in the buckets, each bucket's size and checksum, and the totals. The
    receiver installs nothing until every bucket has arrived and matched."""

    KIND: ClassVar[str] = "weight_manifest"
    version: int
    tensors: list[TensorSpec]
    bucket_sizes: list[int]
    bucket_checksums: list[str]
    total_bytes: int
    checksum: str

    def to_wire(self) -> dict:
        return {"version": self.version, "tensors": [t.to_wire() for t in self.tensors],
                "bucket_sizes": list(self.bucket_sizes), "bucket_checksums": list(self.bucket_checksums),
                "total_bytes": self.total_bytes, "checksum": self.checksum}

    @classmethod
    def from_wire(cls, d: dict, path: str = "") -> WeightManifest:
        version = F.as_int(F.req(d, "version", path), F._join(path, "version"), 0)
        tpath = F._join(path, "tensors")
        tensors = [TensorSpec.from_wire(t, f"{tpath}[{i}]")
                   for i, t in enumerate(F.as_list(F.req(d, "tensors", path), tpath))]
        sizes = [F.as_int(s, f"{F._join(path, 'bucket_sizes')}[{i}]", 0)
                 for i, s in enumerate(F.as_list(F.req(d, "bucket_sizes", path), F._join(path, "bucket_sizes")))]
        sums = [F.as_str(s, f"{F._join(path, 'bucket_checksums')}[{i}]", 64)
                for i, s in enumerate(F.as_list(F.req(d, "bucket_checksums", path), F._join(path, "bucket_checksums")))]
        if len(sums) != len(sizes):
            raise ProtocolError(F._join(path, "bucket_checksums"), f"{len(sizes)} entries (one per bucket)", len(sums))
        total = F.as_int(F.req(d, "total_bytes", path), F._join(path, "total_bytes"), 0)
        if total != sum(sizes):
            raise ProtocolError(F._join(path, "total_bytes"), f"{sum(sizes)} (sum of bucket_sizes)", total)
        for i, t in enumerate(tensors):
            if t.bucket >= len(sizes) or t.offset + t.nbytes > sizes[t.bucket]:
                raise ProtocolError(f"{tpath}[{i}]", "a range inside its bucket",
                                    f"bucket {t.bucket} offset {t.offset} nbytes {t.nbytes}")
        checksum = F.as_str(F.req(d, "checksum", path), F._join(path, "checksum"), 64)
        return cls(version, tensors, sizes, sums, total, checksum)


@dataclass
class WeightBucket:
    """One contiguous chunk of a weight push (raw bytes of several tensors)."""

    KIND: ClassVar[str] = "weight_bucket"
    version: int
    index: int
    data: np.ndarray
    checksum: str

    def __post_init__(self):
        if not isinstance(self.data, np.ndarray) or self.data.dtype != np.uint8:
            view = memoryview(self.data)  # pyright: ignore[reportArgumentType] -- bytes here, not an ndarray
            self.data = np.frombuffer(view.cast("B"), dtype=np.uint8)

    def to_wire(self) -> dict:
        return {"version": self.version, "index": self.index, "data": self.data, "checksum": self.checksum}

    @classmethod
    def from_wire(cls, d: dict, path: str = "") -> WeightBucket:
        version = F.as_int(F.req(d, "version", path), F._join(path, "version"), 0)
        index = F.as_int(F.req(d, "index", path), F._join(path, "index"), 0)
        data = F.as_array(F.req(d, "data", path), F._join(path, "data"), "uint8")
        checksum = F.as_str(F.req(d, "checksum", path), F._join(path, "checksum"), 64)
        return cls(version, index, data, checksum)


Message = TrajectoryGroup | PromptRequest | WeightManifest | WeightBucket | ControlMessage
MESSAGE_TYPES: dict[str, type] = {c.KIND: c for c in
                                  (TrajectoryGroup, PromptRequest, WeightManifest, WeightBucket, ControlMessage)}
