"""rollout.install.direct_load: plain load_weights is used only once proven equal to reload_weights, and a copy plan
only once proven equal to plain load_weights."""
from __future__ import annotations

import pytest
import torch

from rollout.install.direct_load import CopyPlan, DirectLoad, PlanRefused, fingerprint, model_tensors


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
    assert direct.install(model, weights(1.0), reload) == "checked"  # plain vs reload, then the copy plan
    assert direct.proven is True and direct.refused_reason == ""
    assert direct.plan is not None and direct.plan_refused_reason == ""
    assert torch.equal(model.gate_up, torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), -1.0)]))
    assert direct.install(model, weights(3.0), reload) == "copy"
    assert len(reloads) == 1
    assert torch.equal(model.gate_up, torch.cat([torch.full((2, 3), 3.0), torch.full((2, 3), -3.0)]))


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
    assert direct.proven is False and "after being proven" in direct.refused_reason and direct.plan is None
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


class Stacked(torch.nn.Module):
    """Like vLLM's attention: ``q``, ``k``, ``v`` stacked into one fused bf16 parameter by ``load_weights``,
    a norm copied as is, and an embedding tied to the output head (one parameter under two names).
    ``loader``: ``plain``; ``transpose`` (q copied transposed: same range, other order); ``shard`` (only
    the first row of v is kept, like a tensor-parallel shard)."""

    def __init__(self, loader: str = "plain"):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(5, 4, dtype=torch.bfloat16), requires_grad=False)
        self.head = self.embed
        self.loader = loader

    def load_weights(self, weights):
        rows = {"q": (0, 4), "k": (4, 6), "v": (6, 8)}
        for name, w in weights:
            if name in rows:
                lo, hi = rows[name]
                if name == "q" and self.loader == "transpose":
                    w = w.t()
                if name == "v" and self.loader == "shard":
                    self.qkv.data[lo:lo + 1].copy_(w[:1])
                    continue
                self.qkv.data[lo:hi].copy_(w)
            elif name == "norm":
                self.norm.data.copy_(w)
            elif name == "embed":
                self.embed.data.copy_(w)
            elif name != "head":  # skipped: tied to embed
                raise KeyError(name)


def stacked_weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (4, 4), "k": (2, 4), "v": (2, 4), "norm": (4,), "embed": (5, 4), "head": (5, 4)}
    pushed = [(n, torch.randn(shape, generator=g).to(torch.bfloat16)) for n, shape in shapes.items()]
    return lambda: iter(pushed)


def checked(model) -> DirectLoad:
    """Plain load proven (reload == load_weights here), then the copy plan checked, on one push."""
    direct = DirectLoad()
    assert direct.install(model, stacked_weights(1), model.load_weights) == "checked"
    assert direct.proven is True
    expected = type(model)(model.loader)
    expected.load_weights(stacked_weights(1)())
    assert not fingerprint(model).differences(fingerprint(expected))  # ends on load_weights: no marker left
    return direct


def test_copy_plan_records_each_tensors_range_and_installs_like_load_weights():
    model = Stacked()
    direct = checked(model)
    assert direct.plan is not None, direct.plan_refused_reason
    assert [name for name, _ in direct.plan.steps] == ["q", "k", "v", "norm", "embed"]  # head: never loaded
    for seed in (2, 3):
        assert direct.install(model, stacked_weights(seed), model.load_weights) == "copy"
        expected = Stacked()
        expected.load_weights(stacked_weights(seed)())
        assert not fingerprint(model).differences(fingerprint(expected))


def test_copy_plan_is_refused_when_load_weights_reorders_a_tensor_and_plain_load_stays():
    model = Stacked("transpose")
    direct = checked(model)
    assert direct.plan is None and "qkv" in direct.plan_refused_reason
    assert direct.install(model, stacked_weights(2), model.load_weights) == "direct"


def test_copy_plan_is_refused_for_a_tensor_that_lands_in_part():
    model = Stacked("shard")
    with pytest.raises(PlanRefused, match="v .8 elements. lands as a run of 4 in qkv"):
        CopyPlan.discover(model, list(stacked_weights(1)()))
    model = Stacked("shard")
    direct = checked(model)
    assert direct.plan is None and "lands as a run" in direct.plan_refused_reason


def test_a_push_with_other_tensors_than_the_plan_takes_plain_load():
    model = Stacked()
    direct = checked(model)
    fewer = lambda: iter([x for x in stacked_weights(4)() if x[0] != "norm"])  # noqa: E731
    assert direct.install(model, fewer, model.load_weights) == "direct"
    assert direct.plan is not None
    assert torch.equal(model.qkv[:4], dict(stacked_weights(4)())["q"])


def test_checks_leave_out_the_kv_cache_and_work_chunk_by_chunk(monkeypatch):
    import types

    from rollout.install import direct_load

    model = Stacked()
    model.kv_cache = torch.zeros(64, dtype=torch.bfloat16)  # how vLLM 0.25.1 binds it to an attention layer
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(kv_caches=[[model.kv_cache]]))
    assert direct_load.worker_kv_caches(worker) == [model.kv_cache]
    assert "kv_cache" in model_tensors(model) and "kv_cache" not in model_tensors(model, [model.kv_cache])
    monkeypatch.setattr(direct_load, "CHUNK_BYTES", 8)  # 4 bf16 elements: every run crosses chunk boundaries
    before = fingerprint(model, [model.kv_cache])
    model.kv_cache.fill_(1.0)  # generation writes the cache: not a weight difference
    assert not before.differences(fingerprint(model, [model.kv_cache]))
    model.embed.data.view(-1)[17] = 3.0  # a change in the fifth chunk of a tensor
    assert before.differences(fingerprint(model, [model.kv_cache])) == ["embed", "head"]  # tied: one tensor
    flat = model.embed.data.view(-1)
    flat[:8] = torch.arange(8, dtype=torch.bfloat16)
    in_order = fingerprint(model)
    flat[:8] = torch.cat([flat[4:8].clone(), flat[:4].clone()])  # the first two chunks swapped
    assert fingerprint(model).differences(in_order) == ["embed", "head"]
    direct = DirectLoad()
    assert direct.install(model, stacked_weights(1), model.load_weights, ignore=[model.kv_cache]) == "checked"
    assert direct.plan is not None, direct.plan_refused_reason
    assert [(n, dst.numel()) for n, dst in direct.plan.steps] == [("q", 16), ("k", 8), ("v", 8), ("norm", 4),
                                                                  ("embed", 20)]
    assert direct.install(model, stacked_weights(2), model.load_weights, ignore=[model.kv_cache]) == "copy"
    expected = Stacked()
    expected.load_weights(stacked_weights(2)())
    assert torch.equal(model.qkv, expected.qkv) and torch.equal(model.embed, expected.embed)


class Composed(torch.nn.Module):
    """A Mamba mixer as vLLM's NemotronH loads it: the checkpoint's ``A_log`` is stored as ``A = -exp(A_log)``
    (a composed loader); ``D`` is copied as is."""

    def __init__(self):
        super().__init__()
        self.A = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.D = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            if name == "A_log":
                self.A.data.copy_(-torch.exp(w.float()))
            else:
                self.D.data.copy_(w)


def mamba_weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    pushed = [("A_log", torch.randn(4, generator=g)), ("D", torch.randn(4, generator=g))]
    return lambda: iter(pushed)


def test_copy_plan_is_refused_for_a_composed_loader_and_plain_load_keeps_converting():
    with pytest.raises(PlanRefused, match="load_weights writes A without copying a pushed tensor into it"):
        CopyPlan.discover(Composed(), list(mamba_weights(1)()))
    model, direct = Composed(), DirectLoad()
    assert direct.install(model, mamba_weights(1), model.load_weights) == "checked"
    assert direct.proven is True and direct.plan is None
    assert "composed loader" in direct.plan_refused_reason
    assert direct.install(model, mamba_weights(2), model.load_weights) == "direct"
    torch.testing.assert_close(model.A, -torch.exp(dict(mamba_weights(2)())["A_log"]))
