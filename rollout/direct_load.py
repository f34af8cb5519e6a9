"""Install pushed weights with vLLM's plain ``load_weights`` once it is proven equal to ``reload_weights``.

vLLM's ``reload_weights`` (layerwise reload) is the safe way to install new
weights into a running engine: it buffers each layer's checkpoint tensors,
re-runs ``process_weights_after_loading`` (which, for some kernels, reorders
or repacks the weights: FlashInfer CUTLASS MoE swaps the gate/up halves, the
CPU backend repacks linear weights) and copies the result into the tensors
the kernels and CUDA graphs use. For a plain dense model that processing
changes nothing, and the model's own ``load_weights`` -- one narrow + copy per
checkpoint tensor into the fused parameters -- gives the same bytes several
times faster (the layerwise machinery took 74 ms of the ~95 ms export ->
installed for a 2.6 GB model on H200).

Which case a model is in is decided by measurement, not by a list of
architectures. On the first push that changes the weights, the worker:

1. fingerprints every tensor of the model (parameters, buffers and tensor
   attributes, which is where processed kernel copies live) -- ``before``;
2. installs the push with plain ``load_weights`` -- ``plain``;
3. installs the same push with ``reload_weights`` (so the engine ends on the
   safe path's result whatever the outcome) -- ``reloaded``.

If ``reloaded`` equals ``before``, the push changed nothing and the check is
not conclusive: it runs again on the next push. Otherwise plain load is
*proven* for this engine when ``plain == reloaded`` for every tensor (plain
load writes in place, into the storage CUDA graphs read). A derived tensor
that plain load leaves stale, a reordered half or a repacked copy makes them
differ, and the engine keeps ``reload_weights`` for good. A proven plain
load that later raises (a push with other tensors) is repaired by
``reload_weights`` and never tried again. The fingerprint is
:func:`protocol.weight_transfer.device_checksum` of each tensor's bytes
(computed on its device, one host sync per device). The parity probe after
every refit (``logger.parity_max_gen_kl``) still guards the result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from protocol.weight_transfer import ALIGN, _align, device_checksum

MAX_NAMED_DIFFERENCES = 5
"""How many differing tensors a refusal names."""


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a module tree holds: parameters, buffers and plain tensor attributes, by dotted name."""
    found: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        held = dict(module._parameters) | dict(module._buffers)
        held |= {k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}
        for name, tensor in held.items():
            if tensor is not None and tensor.device.type != "meta":
                found[f"{prefix}.{name}" if prefix else name] = tensor
    return found


@dataclass(frozen=True)
class Fingerprint:
    """Each tensor's shape, dtype and device checksum of its bytes, by name."""

    entries: dict[str, tuple[tuple[int, ...], str, int]]

    def differences(self, other: "Fingerprint") -> list[str]:
        names = sorted(set(self.entries) | set(other.entries))
        return [n for n in names if self.entries.get(n) != other.entries.get(n)]


def fingerprint(model: torch.nn.Module) -> Fingerprint:
    """Checksums of every tensor of ``model``, computed on each tensor's device, one host sync per device."""
    tensors = model_tensors(model)
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors.values():
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        if raw.numel() == 0 or raw.numel() % ALIGN:  # device_checksum reads whole rows: pad a copy with zeros
            padded = torch.zeros(_align(max(raw.numel(), ALIGN)), dtype=torch.uint8, device=raw.device)
            padded[:raw.numel()] = raw
            raw = padded
        sums.setdefault(raw.device, []).append(device_checksum(raw))
    values = {device: iter(torch.stack(s).tolist()) for device, s in sums.items()}
    return Fingerprint({name: (tuple(t.shape), str(t.dtype), next(values[t.device]))
                        for name, t in tensors.items()})


class DirectLoad:
    """Per worker: whether plain ``load_weights`` is proven equal to ``reload_weights`` for this model."""

    def __init__(self, enabled: bool = True):
        self.proven: bool | None = None if enabled else False
        """None: not checked yet; True: install with plain load; False: always reload."""
        self.refused_reason = "" if enabled else "disabled (policy.generation.vllm_cfg.direct_weight_load)"

    def install(self, model: torch.nn.Module, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                reload: Callable[[Iterable[tuple[str, torch.Tensor]]], None]) -> str:
        """Install ``weights()`` (called once per pass) into ``model``; returns the path taken:
        ``direct``, ``reload``, or ``checked`` (both ran; the engine ends on reload's result)."""
        if self.proven:
            try:
                model.load_weights(weights())
                return "direct"
            except Exception as exc:  # e.g. a push with other tensors than the proven ones: repair, stop trusting
                self.proven = False
                self.refused_reason = f"plain load_weights raised {type(exc).__name__} after being proven: {exc}"[:300]
                reload(weights())
                return "reload"
        if self.proven is False:
            reload(weights())
            return "reload"
        before = fingerprint(model)
        plain_error = ""
        try:
            model.load_weights(weights())
        except Exception as exc:  # the safe path below repairs whatever the plain load left
            plain_error = f"plain load_weights raised {type(exc).__name__}: {exc}"[:300]
        plain = fingerprint(model)
        reload(weights())
        reloaded = fingerprint(model)
        if plain_error:
            self.proven, self.refused_reason = False, plain_error
        elif not reloaded.differences(before):
            pass  # the push changed nothing: not conclusive, check on the next one
        else:
            differ = plain.differences(reloaded)
            self.proven = not differ
            if differ:
                first = differ[0]
                self.refused_reason = (f"plain load_weights differs from reload_weights in {len(differ)} tensors, "
                                       f"e.g. {', '.join(differ[:MAX_NAMED_DIFFERENCES])}; {first} (shape, dtype, "
                                       f"checksum): before {before.entries.get(first)}, plain "
                                       f"{plain.entries.get(first)}, reload {reloaded.entries.get(first)}")
        return "checked"
