"""Generators of valid protocol messages, shared by the protocol tests.

Two flavours: hypothesis strategies (``messages()`` and one per kind) for the
property tests, and ``random_message(rng)`` driven by a seeded
``numpy.random.Generator`` for the counted fuzzing loops, where hypothesis'
example budget would be too small. Both produce only messages that
:func:`protocol.decode` must accept.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol import (ControlMessage, PromptRequest, Trajectory, TrajectoryGroup, WeightBucket,
                      WeightManifest, masked_fill, pack_buckets)
from protocol.loss_mask import sampled_spans
from protocol.control import CONTROL_ACTIONS
from protocol.messages import FINISH_REASONS, WEIGHT_DTYPES, dtype_itemsize

OK_REASONS = tuple(r for r in FINISH_REASONS if r != "error")
I64 = (-(1 << 63), (1 << 63) - 1)

short_text = st.text(max_size=24)
ident = st.text(min_size=1, max_size=24)
finite = st.floats(allow_nan=False, allow_infinity=False)
non_negative_int = st.integers(0, (1 << 63) - 1)


@st.composite
def trajectories(draw, vocab_size: int) -> Trajectory:
    n = draw(st.integers(0, 48))
    ids = draw(hnp.arrays(np.int32, n, elements=st.integers(0, vocab_size - 1)))
    logprobs = draw(hnp.arrays(np.float32, n, elements=st.floats(
        max_value=0.0, allow_nan=False, allow_infinity=False, width=32)))
    versions = draw(hnp.arrays(np.int32, n, elements=st.integers(0, (1 << 31) - 1)))
    if draw(st.integers(0, 4)) == 0:  # a failed sample: no reward, a reason
        return Trajectory(ids, logprobs, versions, None, "error", draw(ident))
    components = draw(st.dictionaries(ident, finite, max_size=3))  # per-function values (often none)
    reason = draw(st.sampled_from(OK_REASONS))
    if n < 2 or draw(st.booleans()):  # one sampled turn: the default mask (all ones)
        return Trajectory(ids, logprobs, versions, draw(finite), reason, draw(short_text), components)
    mask = draw(hnp.arrays(np.uint8, n, elements=st.integers(0, 1)))  # several turns, environment tokens between
    mask[draw(st.integers(0, n - 1))] = 1
    logprobs, versions = masked_fill(mask, logprobs, versions)
    turns = draw(st.lists(st.sampled_from(OK_REASONS), min_size=sampled_spans(mask),
                          max_size=int(mask.sum())))
    return Trajectory(ids, logprobs, versions, draw(finite), reason, draw(short_text), components, mask, turns)


@st.composite
def trajectory_groups(draw) -> TrajectoryGroup:
    vocab = draw(st.one_of(st.integers(1, 64), st.integers(1, 1 << 24)))
    size = draw(st.integers(1, 6))
    prompt = draw(hnp.arrays(np.int32, draw(st.integers(0, 32)), elements=st.integers(0, vocab - 1)))
    return TrajectoryGroup(
        group_id=draw(ident), prompt_id=draw(ident), prompt_ids=prompt,
        trajectories=[draw(trajectories(vocab)) for _ in range(size)], group_size=size,
        vocab_size=vocab, scheduled_step=draw(non_negative_int), engine_id=draw(short_text),
        created_at=draw(finite))


task_values = st.one_of(short_text, st.integers(*I64), finite)


@st.composite
def prompt_requests(draw) -> PromptRequest:
    ids = draw(hnp.arrays(np.int32, draw(st.integers(0, 64)), elements=st.integers(0, (1 << 31) - 1)))
    return PromptRequest(draw(ident), ids, draw(st.dictionaries(short_text, task_values, max_size=5)),
                         draw(non_negative_int))


@st.composite
def control_messages(draw) -> ControlMessage:
    scalars = st.one_of(short_text, st.integers(*I64), finite, st.booleans(), st.none())
    return ControlMessage(draw(st.sampled_from(CONTROL_ACTIONS)),
                          draw(st.dictionaries(short_text, scalars, max_size=5)), draw(finite))


@st.composite
def weight_pushes(draw) -> tuple[WeightManifest, list[WeightBucket], list[tuple]]:
    """A manifest, its buckets, and the ``(name, dtype, shape, raw)`` tensors they came from."""
    tensors = []
    for i in range(draw(st.integers(0, 6))):
        dtype = draw(st.sampled_from(WEIGHT_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype_itemsize(dtype)
        raw = np.frombuffer(draw(st.binary(min_size=nbytes, max_size=nbytes)), dtype=np.uint8)
        tensors.append((f"layers.{i}.{draw(ident)}", dtype, shape, raw))
    manifest, buckets = pack_buckets(tensors, version=draw(st.integers(0, 1 << 40)),
                                     bucket_bytes=draw(st.integers(1, 160)))
    return manifest, buckets, tensors


@st.composite
def weight_messages(draw):
    manifest, buckets, _ = draw(weight_pushes())
    return draw(st.sampled_from([manifest, *buckets]))


def messages():
    """Any valid message of any kind."""
    return st.one_of(trajectory_groups(), prompt_requests(), control_messages(), weight_messages())


# ----------------------------------------------------------------------------- seeded generator

def random_message(rng: np.random.Generator):
    """A small valid message of a random kind, from a seeded numpy generator."""
    kind = rng.integers(0, 5)
    if kind == 0:
        vocab = int(rng.integers(1, 5000))
        size = int(rng.integers(1, 5))
        trajs = []
        for i in range(size):
            n = int(rng.integers(0, 24))
            ids = rng.integers(0, vocab, n)
            lps = -rng.exponential(1.0, n).astype(np.float32)
            vers = rng.integers(0, 50, n)
            if rng.random() < 0.25:
                trajs.append(Trajectory(ids, lps, vers, None, "error", "reward fn timed out"))
            elif n > 2 and rng.random() < 0.5:  # two sampled turns around an environment turn
                mask = np.ones(n, np.uint8)
                mask[n // 3:2 * n // 3] = 0
                lps, vers = masked_fill(mask, lps, vers)
                trajs.append(Trajectory(ids, lps, vers, float(rng.normal()), "stop", "", {}, mask,
                                        ["stop", str(rng.choice(OK_REASONS))]))
            else:
                trajs.append(Trajectory(ids, lps, vers, float(rng.normal()), str(rng.choice(OK_REASONS))))
        return TrajectoryGroup(f"g{rng.integers(1 << 30)}", "p1", rng.integers(0, vocab, int(rng.integers(0, 16))),
                               trajs, size, vocab, int(rng.integers(0, 100)), "engine-0", float(rng.random()))
    if kind == 1:
        return PromptRequest("p7", rng.integers(0, 1000, int(rng.integers(0, 32))),
                             {"answer": "42", "difficulty": int(rng.integers(0, 5)), "weight": 0.5},
                             int(rng.integers(0, 100)))
    if kind == 2:
        return ControlMessage(str(rng.choice(CONTROL_ACTIONS)), {"engine": "e0", "version": 3, "ok": True,
                                                                 "note": None}, float(rng.random()))
    tensors = [(f"w{i}", "float32", (int(rng.integers(0, 6)), 3), None) for i in range(int(rng.integers(1, 4)))]
    tensors = [(n, d, s, rng.integers(0, 256, int(np.prod(s)) * 4).astype(np.uint8)) for n, d, s, _ in tensors]
    manifest, buckets = pack_buckets(tensors, version=int(rng.integers(0, 100)), bucket_bytes=48)
    return manifest if kind == 3 else buckets[int(rng.integers(0, len(buckets)))]


# ----------------------------------------------------------------------------- comparison

def assert_same_message(a, b, path: str = "") -> None:
    """Field-wise equality; arrays must match in dtype, shape and values."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same_message(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert a.tobytes() == b.tobytes(), f"{path}: values differ"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_message(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys differ"
        for k in a:
            assert_same_message(a[k], b[k], f"{path}.{k}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
