"""The experts the engine routed each token to, carried for routing replay (schema 3).

A mixture-of-experts router picks its top-k experts per token from logits that can be nearly tied; the engine
and the learner compute them with different kernels, so a near tie can flip and the learner then scores a token
through experts the engine never used. Routing replay (R3) has the engine return the experts it routed each
position to (vLLM's ``CompletionOutput.routed_experts``, ``[positions, layers, top_k]``) and the learner's router
use exactly those. The trajectory carries them as ``routed_experts``: ``uint8`` (or ``uint16`` with more than 256
experts) ``[P, L, K]``, where position ``p`` counts from the prompt's first token (the prompt, then the response),
``L`` is the model's **MoE** layers in order (:func:`moe_layers`: dense and Mamba layers carry nothing), ``K`` its
top-k. ``P`` may be shorter than the sequence: positions from ``P`` on have no engine routing and the learner
routes them itself (the last response token is never fed to the engine, so ``P`` is at most prompt + response
- 1 in practice; at most prompt + response here).

The field is optional: absent, the learner routes every token itself. It exists from schema 3 on; a schema 1 or
2 message must not have it, and a group is written at schema 3 only when one of its trajectories carries routing
(:func:`group_schema`), so a reader of schema 2 still reads every group written without replay.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from protocol import fields as F
from protocol.errors import ProtocolError

ROUTING_SCHEMA = 3
"""The first schema version that has ``routed_experts``."""
ROUTING_DTYPES = ("uint8", "uint16")
MAX_MOE_LAYERS = 512
MAX_TOP_K = 64
MAX_ROUTING_BYTES = 1 << 28
"""At most 256 MiB of routing per trajectory (e.g. 64k positions x 64 layers x top-8 as uint8 is 32 MiB)."""


def moe_layers(hf_config: Mapping[str, object]) -> tuple[int, ...]:
    """The 0-based indices of the decoder layers of an HF ``config.json`` that route tokens to experts:
    Nemotron-H's ``E`` positions of its hybrid pattern; Qwen3-MoE-style models every layer except
    ``mlp_only_layers`` and those off ``decoder_sparse_step``; () for a dense model."""
    text = hf_config.get("text_config")
    cfg: dict[str, Any] = dict(text if isinstance(text, Mapping) else hf_config)
    pattern = cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type")
    if isinstance(pattern, str):
        return tuple(i for i, c in enumerate(pattern) if c == "E")
    if isinstance(pattern, list):
        return tuple(i for i, c in enumerate(pattern) if c in ("moe", "E"))
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if not experts:
        return ()
    n = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    return tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)


def compact(routed: np.ndarray, layers: Sequence[int]) -> np.ndarray:
    """vLLM's ``routed_experts`` ``[P, all decoder layers, K]`` cut to the MoE ``layers``, in the narrowest
    dtype of :data:`ROUTING_DTYPES` that holds its largest expert id."""
    arr = np.asarray(routed)
    if arr.ndim != 3:
        raise ValueError(f"routed experts: expected [positions, layers, top_k], got shape {arr.shape}")
    if layers and max(layers) >= arr.shape[1]:
        raise ValueError(f"routed experts: MoE layer {max(layers)} but the engine returned {arr.shape[1]} layers")
    out = arr[:, list(layers), :]
    if out.size and (out.min() < 0 or out.max() > np.iinfo(np.uint16).max):
        raise ValueError(f"routed experts: expert ids must lie in [0, 65535], got {out.min()}..{out.max()}")
    dtype = np.uint8 if not out.size or out.max() <= np.iinfo(np.uint8).max else np.uint16
    return np.ascontiguousarray(out, dtype=dtype)


def check_routed_experts(v: object, path: str, max_positions: int) -> np.ndarray:
    """``routed_experts``: a 3-d ``uint8``/``uint16`` array of at most ``max_positions`` positions,
    :data:`MAX_MOE_LAYERS` layers, :data:`MAX_TOP_K` experts per token and :data:`MAX_ROUTING_BYTES` bytes, with
    ``K`` distinct experts at every (position, layer)."""
    where = f"{path}.routed_experts"
    if not isinstance(v, np.ndarray) or v.dtype.name not in ROUTING_DTYPES:
        got = v.dtype.name if isinstance(v, np.ndarray) else type(v).__name__
        raise ProtocolError(where, f"an ndarray of {' or '.join(ROUTING_DTYPES)}", got)
    arr = F.as_array(v, where, v.dtype.name, ndim=3)
    p, layers, k = arr.shape
    for what, got, hi in (("positions", p, max_positions), ("MoE layers", layers, MAX_MOE_LAYERS),
                          ("experts per token", k, MAX_TOP_K)):
        if got > hi:
            raise ProtocolError(where, f"at most {hi} {what}", got)
    if p and (layers == 0 or k == 0):
        raise ProtocolError(where, "at least one MoE layer and one expert per token", f"shape {arr.shape}")
    if arr.nbytes > MAX_ROUTING_BYTES:
        raise ProtocolError(where, f"at most {MAX_ROUTING_BYTES} bytes", arr.nbytes)
    if k > 1 and arr.size:
        ordered = np.sort(arr, axis=-1)
        bad = np.argwhere(ordered[..., 1:] == ordered[..., :-1])
        if bad.size:
            i, layer = int(bad[0][0]), int(bad[0][1])
            raise ProtocolError(f"{where}[{i}, {layer}]", f"{k} distinct experts", arr[i, layer].tolist())
    return arr


def read_routed_experts(d: dict, path: str, schema: int, max_positions: int) -> np.ndarray | None:
    """The optional ``routed_experts`` of the trajectory map ``d``, checked; None when absent. Before schema 3 the
    key must be absent."""
    if "routed_experts" not in d:
        return None
    if schema < ROUTING_SCHEMA:
        raise ProtocolError(f"{path}.routed_experts", f"absent in a schema {schema} message (a schema 3 field)",
                            "present")
    return check_routed_experts(d["routed_experts"], path, max_positions)


def group_schema(routings: Sequence[np.ndarray | None]) -> int:
    """The schema a trajectory group is written at: 3 when a trajectory carries routing, else 2."""
    return ROUTING_SCHEMA if any(r is not None for r in routings) else ROUTING_SCHEMA - 1
