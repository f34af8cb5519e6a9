"""rollout.direct_load: plain load_weights is used only once proven equal to reload_weights."""
from __future__ import annotations

import pytest
import torch

from rollout.direct_load import DirectLoad, fingerprint, model_tensors


class Fused(torch.nn.Module):
    """A layer whose checkpoint has ``gate`` and ``up``; the model holds them fused, like vLLM's gate_up_proj.
    ``swap_after_processing``: the reload's post-processing swaps the halves (FlashInfer CUTLASS MoE);
    ``derived``: it also keeps a processed copy as a plain attribute (a repacked kernel weight)."""

    def __init__(self, swap_after_processing: bool = False, derived: bool = False):
        super().__init__()
        self.gate_up = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
        self.swap, self.derived = swap_after_processing, derived
        self.packed = self.gate_up.detach().clone() * 2 if derived else None

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            half = {"gate": 0, "up": 1}[name]
            self.gate_up.data[half * 2:(half + 1) * 2].copy_(w)
            loaded.add(name)
        return loaded

    def reload(self, weights):
        self.load_weights(weights)
        if self.swap:
            self.gate_up.data.copy_(torch.cat([self.gate_up.data[2:], self.gate_up.data[:2]]))
        if self.derived:
            self.packed.copy_(self.gate_up.data * 2)


def weights(scale: float):
    return lambda: iter([("gate", torch.full((2, 3), scale)), ("up", torch.full((2, 3), -scale))])


def test_plain_load_is_proven_for_a_model_without_processing_then_used():
    model, direct = Fused(), DirectLoad()
    reloads = []
    reload = lambda w: (reloads.append(1), model.reload(w))  # noqa: E731
    assert direct.install(model, weights(1.0), reload) == "checked"
    assert direct.proven is True and direct.refused_reason == ""
    assert direct.install(model, weights(2.0), reload) == "direct"
    assert len(reloads) == 1
    assert torch.equal(model.gate_up, torch.cat([torch.full((2, 3), 2.0), torch.full((2, 3), -2.0)]))


@pytest.mark.parametrize("kind", ["swapped halves", "stale derived tensor"])
def test_plain_load_is_refused_when_processing_changes_the_result_and_reload_wins(kind):
    model = Fused(swap_after_processing=kind == "swapped halves", derived=kind == "stale derived tensor")
    direct = DirectLoad()
    assert direct.install(model, weights(1.0), model.reload) == "checked"
    assert direct.proven is False
    assert ("gate_up" if kind == "swapped halves" else "packed") in direct.refused_reason
    expected = Fused(model.swap, model.derived)
    expected.reload(weights(1.0)())
    assert fingerprint(model).entries.keys() == fingerprint(expected).entries.keys()
    assert torch.equal(model.gate_up, expected.gate_up)  # the engine ends on reload's result
    assert direct.install(model, weights(3.0), model.reload) == "reload"


def test_a_push_that_changes_nothing_does_not_decide():
    model, direct = Fused(swap_after_processing=True), DirectLoad()
    model.reload(weights(1.0)())
    assert direct.install(model, weights(1.0), model.reload) == "checked"
    assert direct.proven is None
    assert direct.install(model, weights(5.0), model.reload) == "checked"
    assert direct.proven is False


def test_plain_load_that_raises_is_refused_and_repaired_by_reload():
    model, direct = Fused(), DirectLoad()
    bad = lambda: iter([("gate", torch.ones(2, 3)), ("nope", torch.ones(2, 3))])  # noqa: E731
    assert direct.install(model, bad, lambda w: model.reload([x for x in w if x[0] != "nope"])) == "checked"
    assert direct.proven is False and "KeyError" in direct.refused_reason


def test_a_proven_plain_load_that_raises_later_falls_back_to_reload_for_good():
    model, direct = Fused(), DirectLoad()
    direct.install(model, weights(1.0), model.reload)
    assert direct.proven is True
    odd = lambda: iter([("gate", torch.full((2, 3), 4.0)), ("extra", torch.ones(1))])  # noqa: E731
    assert direct.install(model, odd, lambda w: model.reload([x for x in w if x[0] != "extra"])) == "reload"
    assert direct.proven is False and "after being proven" in direct.refused_reason
    assert torch.equal(model.gate_up[:2], torch.full((2, 3), 4.0))
    assert direct.install(model, weights(1.0), model.reload) == "reload"


def test_disabled_always_reloads():
    model, direct = Fused(), DirectLoad(enabled=False)
    assert direct.install(model, weights(1.0), model.reload) == "reload"
    assert "disabled" in direct.refused_reason


def test_fingerprint_sees_every_byte_shape_and_dtype_of_parameters_and_tensor_attributes():
    model = Fused(derived=True)
    assert set(model_tensors(model)) == {"gate_up", "packed"}
    before = fingerprint(model)
    assert not before.differences(fingerprint(model))
    model.packed = model.packed.clone()  # same values, new storage: the same tensor as far as kernels care
    assert not before.differences(fingerprint(model))
    model.gate_up.data.view(-1).view(torch.uint8)[5] ^= 1  # one bit
    assert before.differences(fingerprint(model)) == ["gate_up"]
    model.packed = model.packed.to(torch.float64)
    assert "packed" in before.differences(fingerprint(model))
    model.packed = torch.zeros(256)  # 1024 bytes: a whole checksum row, checksummed in place (no padded copy)
    aligned = fingerprint(model)
    model.packed.view(torch.uint8)[1000] ^= 1
    assert aligned.differences(fingerprint(model)) == ["packed"]
