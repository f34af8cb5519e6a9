"""The per-token loss mask of a multi-turn trajectory (schema 2).

A trajectory's response is its sampled turns and the environment's turns laid end to end; ``loss_mask`` is 1
at the tokens the engine sampled (trained) and 0 at the environment's (context only). Environment tokens have
no log-prob or policy version of their own, so they carry canonical values (:func:`masked_fill`): log-prob 0.0
and the version of the nearest sampled token before them. The minimum (and maximum) version over all tokens is
then the one over the sampled tokens, and a sum of log-probs is the sampled tokens' sum, so even a reader that
ignores the mask gets staleness right. :func:`read_turn_fields` reads the two fields (absent in schema 1: all
tokens sampled, one turn) with the rules of docs/protocol.md, "Trajectory".
"""
from __future__ import annotations

import numpy as np

from protocol import fields as F
from protocol.errors import ProtocolError

MAX_TURNS = 4096


def masked_fill(mask: np.ndarray, logprobs: np.ndarray, versions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The canonical log-probs and versions of a response with loss mask ``mask``: 0.0 and the version of the
    nearest sampled token before it (the first sampled token's for environment tokens ahead of every sampled
    one; 0 when nothing was sampled) at each environment (mask 0) position, the given values elsewhere. A
    writer of multi-turn trajectories calls this; :meth:`Trajectory.from_wire` accepts nothing else."""
    keep = np.asarray(mask) == 1
    lps = np.where(keep, logprobs, np.float32(0.0)).astype(np.float32)
    at = np.flatnonzero(keep)
    if at.size == 0:
        return lps, np.zeros(keep.size, np.int32)
    source = np.maximum.accumulate(np.where(keep, np.arange(keep.size), -1))
    source[source < 0] = at[0]
    return lps, np.asarray(versions, np.int32)[source]


def sampled_spans(mask: np.ndarray) -> int:
    """Number of maximal runs of sampled (1) tokens in ``mask``."""
    m = np.asarray(mask) == 1
    return int(m[0]) + int(np.count_nonzero(m[1:] & ~m[:-1])) if m.size else 0


def read_turn_fields(d: dict, path: str, schema: int, reason: str, lps: np.ndarray, vers: np.ndarray,
                     reasons: tuple[str, ...]) -> tuple[np.ndarray, list[str]]:
    """``loss_mask`` and ``turn_finish_reasons`` of the trajectory map ``d`` at ``path``, checked. In a schema 1
    message (written before them) both keys must be absent and every token is sampled, in one turn."""
    n = lps.shape[0]
    if schema == 1:
        for key in ("loss_mask", "turn_finish_reasons"):
            if key in d:
                raise ProtocolError(f"{path}.{key}", "absent in a schema 1 message (a schema 2 field)", "present")
        return np.ones(n, np.uint8), [reason]
    mask = check_loss_mask(F.req(d, "loss_mask", path), path, n, reason, lps, vers)
    return mask, check_turn_reasons(F.req(d, "turn_finish_reasons", path), f"{path}.turn_finish_reasons", mask,
                                    reasons)


def check_loss_mask(v: object, path: str, n: int, reason: str, lps: np.ndarray, vers: np.ndarray) -> np.ndarray:
    """``loss_mask``: uint8[n] of 0/1, a sampled token in a non-empty sample that did not fail, and the
    canonical log-probs and versions at its environment tokens (:func:`masked_fill`)."""
    mask = F.as_array(v, f"{path}.loss_mask", "uint8", length=n)
    bad = np.flatnonzero(mask > 1)
    if bad.size:
        i = int(bad[0])
        raise ProtocolError(f"{path}.loss_mask[{i}]", "0 (environment token) or 1 (sampled token)", int(mask[i]))
    if n and reason != "error" and not mask.any():
        raise ProtocolError(f"{path}.loss_mask", "at least one sampled (1) token in a sample that did not fail",
                            f"{n} environment (0) tokens")
    if mask.all():
        return mask
    want_lps, want_vers = masked_fill(mask, lps, vers)
    for name, got, want, why in (("logprobs", lps, want_lps, ""),
                                 ("versions", vers, want_vers, ": the version of the nearest sampled token before it")):
        bad = np.flatnonzero(got != want)
        if bad.size:
            i = int(bad[0])
            raise ProtocolError(f"{path}.{name}[{i}]", f"{want[i].item()} (environment token, loss_mask 0{why})",
                                got[i].item())
    return mask


def check_turn_reasons(v: object, path: str, mask: np.ndarray, reasons: tuple[str, ...]) -> list[str]:
    """One finish reason per sampled turn: at least one per run of sampled tokens (two turns with no environment
    token between them are one run), at most one per sampled token (or one, when nothing was sampled)."""
    raw = F.as_list(v, path, MAX_TURNS)
    turns = [F.as_str(r, f"{path}[{i}]") for i, r in enumerate(raw)]
    for i, r in enumerate(turns):
        if r not in reasons:
            raise ProtocolError(f"{path}[{i}]", f"one of {reasons}", r)
    lo, hi = max(sampled_spans(mask), 1), max(int(np.count_nonzero(mask)), 1)
    if not lo <= len(turns) <= hi:
        raise ProtocolError(path, f"{lo} to {hi} entries (one per sampled turn)", len(turns))
    return turns
