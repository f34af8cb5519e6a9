"""Install pushed weights with vLLM's plain ``load_weights``, or a copy plan, once proven equal to reload.

vLLM's layerwise ``reload_weights`` is always correct (it re-runs each layer's
``process_weights_after_loading``, which repacks CPU linear weights and
reorders FlashInfer CUTLASS MoE gate/up halves). For a plain dense model that
processing changes nothing and the model's own ``load_weights`` is 4-5x
faster. :class:`DirectLoad` decides by measurement (fingerprints of every
tensor after a plain load and after a reload, on the first push that changes
the weights); :class:`CopyPlan` then records plain load's copies with marker
tensors and, once proven equal too, installs a push with one
``torch._foreach_copy_``. docs/rollout.md ("Install path", "Copy plan") has
the method and the measurements.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from protocol.weight_transfer import ALIGN, _align, device_checksum

MAX_NAMED_DIFFERENCES = 5
"""How many differing tensors a refusal names."""


CHUNK_BYTES = 64 << 20
"""Tensors are checksummed and scanned in chunks of this many bytes, so no pass needs more than a chunk's
worth of scratch memory on a GPU already filled by vLLM's KV cache."""


def model_tensors(model: torch.nn.Module, ignore: Iterable[torch.Tensor] = ()) -> dict[str, torch.Tensor]:
    """Every tensor a module tree holds: parameters, buffers and plain tensor attributes, by dotted name;
    except tensors sharing storage with one of ``ignore`` (the KV cache, which vLLM 0.25.1 binds to each
    attention layer as a plain attribute: tens of GB that are not weights)."""
    skip = {t.untyped_storage().data_ptr() for t in ignore}
    found: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        held = dict(module._parameters) | dict(module._buffers)
        held |= {k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}
        for name, tensor in held.items():
            if tensor is not None and tensor.device.type != "meta" and (
                    not skip or tensor.untyped_storage().data_ptr() not in skip):
                found[f"{prefix}.{name}" if prefix else name] = tensor
    return found


def worker_kv_caches(worker) -> list[torch.Tensor]:
    """The KV cache tensors of a vLLM worker (``model_runner.kv_caches``, nested lists flattened)."""
    out, todo = [], [getattr(getattr(worker, "model_runner", None), "kv_caches", None) or []]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
    return out


@dataclass(frozen=True)
class Fingerprint:
    """Each tensor's shape, dtype and device checksum of its bytes, by name."""

    entries: dict[str, tuple[tuple[int, ...], str, int]]

    def differences(self, other: Fingerprint) -> list[str]:
        names = sorted(set(self.entries) | set(other.entries))
        return [n for n in names if self.entries.get(n) != other.entries.get(n)]


def _checksum(raw: torch.Tensor) -> torch.Tensor:
    """:func:`device_checksum` of a uint8 tensor of any length, chunk by chunk (each weighted by its
    position); a last partial row is checksummed from a zero-padded copy."""
    total = None
    for k, start in enumerate(range(0, max(raw.numel(), 1), CHUNK_BYTES)):
        chunk = raw[start:start + CHUNK_BYTES]
        if chunk.numel() == 0 or chunk.numel() % ALIGN:  # device_checksum reads whole rows
            padded = torch.zeros(_align(max(chunk.numel(), ALIGN)), dtype=torch.uint8, device=raw.device)
            padded[:chunk.numel()] = chunk
            chunk = padded
        part = device_checksum(chunk) * (k + 1)
        total = part if total is None else total + part
    assert total is not None  # the loop runs at least once
    return total


def fingerprint(model: torch.nn.Module, ignore: Iterable[torch.Tensor] = ()) -> Fingerprint:
    """Checksums of every tensor of ``model`` but ``ignore``, computed on each tensor's device, one host
    sync per device."""
    tensors = model_tensors(model, ignore)
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors.values():
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        sums.setdefault(raw.device, []).append(_checksum(raw))
    values = {device: iter(torch.stack(s).tolist()) for device, s in sums.items()}
    return Fingerprint({name: (tuple(t.shape), str(t.dtype), next(values[t.device]))
                        for name, t in tensors.items()})


MARKER_BASE = {2: 0x7000, 4: 0x70000000}
"""Bit pattern of marker 0 by element size: bf16 ~2**97, fp16 ~2**13 (below its inf at 0x7C00), fp32 ~2**97."""
MAX_MARKERS = 0xC00
"""Markers a 2-byte float can carry below fp16's inf (and bf16's)."""
_INT_VIEWS = {2: torch.int16, 4: torch.int32}


class PlanRefused(RuntimeError):
    """The push's copies cannot be recorded as whole contiguous ranges."""


class CopyPlan:
    """Where each pushed tensor lands in the model (found with markers); installs a push in one foreach copy."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 steps: list[tuple[str, torch.Tensor]]):
        self.shapes = shapes
        """Pushed tensor name -> (shape, dtype) the plan was made for."""
        self.steps = steps
        """(pushed tensor name, flat view of the model range it is copied to), in push order."""

    @classmethod
    def discover(cls, model: torch.nn.Module, pushed: list[tuple[str, torch.Tensor]],
                 ignore: Iterable[torch.Tensor] = ()) -> CopyPlan:
        """Load markers shaped like ``pushed`` with ``model.load_weights`` and record where each landed
        (in every model tensor but ``ignore``). Leaves markers in the model: the caller installs real
        weights afterwards."""
        if len(pushed) > MAX_MARKERS:
            raise PlanRefused(f"{len(pushed)} pushed tensors; markers exist for at most {MAX_MARKERS}")
        for name, t in pushed:
            if not t.is_floating_point() or t.element_size() not in MARKER_BASE:
                raise PlanRefused(f"{name} has dtype {t.dtype}; markers need a 2- or 4-byte float")

        def markers():
            for i, (name, t) in enumerate(pushed):
                size = t.element_size()
                yield name, torch.full(t.shape, MARKER_BASE[size] + i, dtype=_INT_VIEWS[size],
                                       device=t.device).view(t.dtype)

        before = fingerprint(model, ignore)
        _plain_load(model, markers())
        changed = set(fingerprint(model, ignore).differences(before))
        tensors = model_tensors(model, ignore)
        landed: dict[int, list[tuple[str, int, int]]] = {}
        seen = set()
        for tname, t in tensors.items():
            size = t.element_size()
            key = (t.data_ptr(), t.numel(), t.dtype)
            if not t.is_floating_point() or size not in MARKER_BASE or not t.is_contiguous() or key in seen:
                continue
            seen.add(key)
            for i, start, count in _marker_runs(t.detach().view(-1).view(_INT_VIEWS[size]), MARKER_BASE[size],
                                                len(pushed)):
                landed.setdefault(i, []).append((tname, start, count))
        # A tensor load_weights changed that shares no storage with a marker's landing place holds a value the
        # loader computed (e.g. NemotronH's A = -exp(A_log)), which no copy reproduces.
        storage = {name: t.untyped_storage().data_ptr() for name, t in tensors.items()}
        holding = {storage[tname] for runs in landed.values() for tname, _, _ in runs}
        converted = sorted(n for n in changed if n in storage and storage[n] not in holding)
        if converted:
            raise PlanRefused(f"load_weights writes {', '.join(converted[:MAX_NAMED_DIFFERENCES])} without "
                              f"copying a pushed tensor into it (a composed loader converts the values)")
        steps = []
        for i, (name, t) in enumerate(pushed):
            for tname, start, count in landed.get(i, []):
                if count != t.numel():
                    raise PlanRefused(f"{name} ({t.numel()} elements) lands as a run of {count} in {tname} "
                                      f"(a shard or a partial copy)")
                steps.append((name, tensors[tname].detach().view(-1)[start:start + count]))
        return cls({n: (tuple(t.shape), t.dtype) for n, t in pushed}, steps)

    def fits(self, pushed: dict[str, torch.Tensor]) -> bool:
        """True if ``pushed`` has exactly the plan's tensor names, shapes and dtypes."""
        return pushed.keys() == self.shapes.keys() and all(
            (tuple(t.shape), t.dtype) == self.shapes[n] for n, t in pushed.items())

    def install(self, pushed: dict[str, torch.Tensor]) -> None:
        dsts = [dst for _, dst in self.steps]
        srcs = [pushed[name].reshape(-1) for name, _ in self.steps]
        if dsts:
            torch._foreach_copy_(dsts, srcs)  # pyright: ignore[reportPrivateImportUsage] -- torch's fused copy


def _plain_load(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """vLLM's plain ``model.load_weights`` (every vLLM model has one; ``nn.Module`` does not declare it)."""
    model.load_weights(weights)  # pyright: ignore[reportCallIssue] -- nn.Module's __getattr__ claims a Tensor


def _marker_runs(flat: torch.Tensor, base: int, count: int) -> list[tuple[int, int, int]]:
    """``(marker, start, length)`` of every run of one marker ``base + i`` (``0 <= i < count``) in the integer
    view ``flat``, scanned in chunks (a run crossing a chunk boundary is joined)."""
    runs: list[list[int]] = []
    step = max(1, CHUNK_BYTES // flat.element_size())
    for offset in range(0, flat.numel(), step):
        chunk = flat[offset:offset + step]
        valid = (chunk >= base) & (chunk < base + count)
        if not bool(valid.any()):
            continue
        index = torch.where(valid, chunk - base, torch.full_like(chunk, -1))
        values, lengths = torch.unique_consecutive(index, return_counts=True)
        starts = torch.cumsum(lengths, 0) - lengths
        keep = values >= 0
        for i, start, length in zip(values[keep].tolist(), starts[keep].tolist(), lengths[keep].tolist(), strict=True):
            if runs and runs[-1][0] == i and runs[-1][1] + runs[-1][2] == offset + start:
                runs[-1][2] += length
            else:
                runs.append([i, offset + start, length])
    return [(r[0], r[1], r[2]) for r in runs]


class DirectLoad:
    """Per worker: whether plain ``load_weights`` is proven equal to ``reload_weights`` for this model, and
    whether a :class:`CopyPlan` is proven equal to plain ``load_weights``."""

    def __init__(self, enabled: bool = True):
        self.proven: bool | None = None if enabled else False
        """None: not checked yet; True: install with plain load; False: always reload."""
        self.refused_reason = "" if enabled else "disabled (policy.generation.vllm_cfg.direct_weight_load)"
        self.plan: CopyPlan | None = None
        """The proven copy plan (installs take the ``copy`` path), once there is one."""
        self.plan_refused_reason = ""

    def install(self, model: torch.nn.Module, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                reload: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
                ignore: Iterable[torch.Tensor] = ()) -> str:
        """Install ``weights()`` (called once per pass) into ``model``; returns the path taken:
        ``copy`` (the proven copy plan), ``direct`` (plain load), ``reload``, or ``checked`` (two paths
        ran and were compared; the engine ends on the safer one's result). ``ignore``: tensors the checks
        leave out (the KV cache: :func:`worker_kv_caches`)."""
        ignore = list(ignore)
        if self.proven:
            try:
                if self.plan is not None:
                    pushed = dict(weights())
                    if self.plan.fits(pushed):
                        self.plan.install(pushed)
                        return "copy"
                _plain_load(model, weights())
                return "direct"
            except Exception as exc:  # noqa: BLE001 - e.g. a push with other tensors than the proven ones: repair, stop trusting
                self.proven, self.plan = False, None
                self.refused_reason = f"plain load_weights raised {type(exc).__name__} after being proven: {exc}"[:300]
                reload(weights())
                return "reload"
        if self.proven is False:
            reload(weights())
            return "reload"
        before = fingerprint(model, ignore)
        plain_error = ""
        try:
            _plain_load(model, weights())
        except Exception as exc:  # noqa: BLE001 - the safe path below repairs whatever the plain load left
            plain_error = f"plain load_weights raised {type(exc).__name__}: {exc}"[:300]
        plain = fingerprint(model, ignore)
        reload(weights())
        reloaded = fingerprint(model, ignore)
        if plain_error:
            self.proven, self.refused_reason = False, plain_error
        elif not reloaded.differences(before):
            pass  # the push changed nothing: not conclusive, check on the next one
        else:
            differ = plain.differences(reloaded)
            self.proven = not differ
            if differ:
                self.refused_reason = _refusal("plain load_weights", "reload_weights", differ, before, plain,
                                               reloaded)
            else:
                self._check_plan(model, weights, ignore)  # on the same push: later ones can take the plan
        return "checked"

    def _check_plan(self, model: torch.nn.Module, weights, ignore: list[torch.Tensor]) -> None:
        """Find a copy plan with markers, install the push through it, then with plain ``load_weights``
        (which the engine ends on); keep the plan only if both give the same tensors."""
        pushed = list(weights())
        plan = None
        try:
            plan = CopyPlan.discover(model, pushed, ignore)
            marked = fingerprint(model, ignore)
            plan.install(dict(pushed))
            planned = fingerprint(model, ignore)
        except Exception as exc:  # noqa: BLE001 - load_weights below restores every tensor the markers touched
            plan, self.plan_refused_reason = None, f"{type(exc).__name__}: {exc}"[:300]
        _plain_load(model, weights())
        if plan is None:
            return
        loaded = fingerprint(model, ignore)
        differ = planned.differences(loaded)
        if differ:
            self.plan_refused_reason = _refusal("the copy plan", "plain load_weights", differ, marked, planned,
                                                loaded)
        else:
            self.plan = plan


def _refusal(fast: str, safe: str, differ: list[str], before: Fingerprint, fast_print: Fingerprint,
             safe_print: Fingerprint) -> str:
    first = differ[0]
    return (f"{fast} differs from {safe} in {len(differ)} tensors, e.g. {', '.join(differ[:MAX_NAMED_DIFFERENCES])};"
            f" {first} (shape, dtype, checksum): before {before.entries.get(first)}, {fast.split()[-1]} "
            f"{fast_print.entries.get(first)}, {safe.split()[-1]} {safe_print.entries.get(first)}")
