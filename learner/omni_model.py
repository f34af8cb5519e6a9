"""Nemotron-3-Nano-Omni in the learner: the Nemotron-H hybrid model with the RADIO vision side inside.

:class:`OmniHybridModel` is a :class:`~learner.hybrid_model.HybridModel` (Mamba2 / attention / MLP / MoE layers, no
position embeddings) that also holds :class:`~learner.radio_tower.RadioVision` as its submodule ``visual``. Its
forward embeds the tokens with Megatron's word embedding, runs the tower on the micro-batch's images
(:class:`OmniImages`) and scatters the image embeddings at the prompt's ``<image>`` positions, image after image,
then runs the hybrid stack on that ``decoder_input``: what transformers' ``NemotronH_Omni_Reasoning_V3.forward`` and
vLLM's ``nano_nemotron_vl`` do. Nemotron-H has no RoPE, so image tokens need no positions of their own.

Weights (:func:`load_omni_weights`): the language model from the published ``language_model.backbone.*`` /
``language_model.lm_head.weight`` through :mod:`learner.hybrid_weights` (tensor-parallel shards as for Nemotron-H),
the vision side through :mod:`learner.radio_weights` (replicated). Frozen tower by default.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from learner.config import MegatronConfig
from learner.hf_config import HFArchitecture, parse_hf_config
from learner.hybrid_model import HybridModel
from learner.radio_tower import RadioSpec, RadioVision

LM_PREFIX = "language_model."
"""The published checkpoint's prefix of the language model's tensors."""


def read_omni_architecture(model_path: str | Path) -> tuple[HFArchitecture, RadioSpec]:
    """The language model's :class:`HFArchitecture` (its ``text_config``, a Nemotron-H) and the :class:`RadioSpec`."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    spec = RadioSpec.of(cfg)
    text = dict(cfg.get("text_config") or cfg["llm_config"])
    text["model_type"] = "nemotron_h"
    return parse_hf_config(text), spec


@dataclass
class OmniImages:
    """A micro-batch's images: RADIO's packed patches (image after image), each image's patch grid, and the
    ``[b, s]`` mask of the positions that receive their embeddings."""

    pixel_values: torch.Tensor
    image_grid_hw: torch.Tensor
    token_mask: torch.Tensor


class OmniHybridModel(HybridModel):
    """``HybridModel`` with the vision side ``visual``; see the module docstring."""

    def __init__(self, *args: Any, visual: RadioVision, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.visual = visual

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                decoder_input: torch.Tensor | None = None, labels: torch.Tensor | None = None, *args: Any,
                images: OmniImages | None = None, **kwargs: Any) -> torch.Tensor:
        if decoder_input is None:
            decoder_input = self.embed(input_ids, position_ids, images)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels, *args, **kwargs)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, images: OmniImages | None) -> torch.Tensor:
        """``[s, b, h]`` word embeddings of ``input_ids`` with the image embeddings at ``images.token_mask``."""
        emb = self.embedding(input_ids=input_ids, position_ids=position_ids)
        if images is None:
            return emb
        feats = self.visual(images.pixel_values, images.image_grid_hw)
        mask = images.token_mask
        if mask.shape != input_ids.shape or int(mask.sum()) != feats.shape[0]:
            raise ValueError(f"the micro-batch marks {int(mask.sum())} image positions (mask {tuple(mask.shape)}, "
                             f"tokens {tuple(input_ids.shape)}); its images give {feats.shape[0]} embeddings")
        return emb.transpose(0, 1).masked_scatter(mask[..., None], feats.to(emb.dtype)).transpose(0, 1)


def build_omni_model(arch: HFArchitecture, spec: RadioSpec, megatron: MegatronConfig,
                     core_attention: type | None = None, freeze_vision_tower: bool = True) -> OmniHybridModel:
    """An :class:`OmniHybridModel` (random init) of ``arch`` and ``spec``, its tower frozen unless asked."""
    from learner.hybrid_model import hybrid_stack_spec, hybrid_transformer_config
    from learner.model import define_missing_te_symbols

    if megatron.pipeline_model_parallel_size > 1:
        raise ValueError("pipeline_model_parallel_size > 1: Nano-Omni needs pipeline_model_parallel_size 1")
    if arch.hybrid is None:
        raise ValueError(f"the language model of a Nano-Omni must be a Nemotron-H, got {arch.model_type!r}")
    config = hybrid_transformer_config(arch, megatron)
    if arch.is_moe:
        define_missing_te_symbols()
    model = OmniHybridModel(config=config, mamba_stack_spec=hybrid_stack_spec(arch, core_attention),
                            vocab_size=arch.vocab_size, max_sequence_length=arch.max_position_embeddings,
                            hybrid_override_pattern=arch.hybrid.pattern, pre_process=True, post_process=True,
                            parallel_output=True, share_embeddings_and_output_weights=arch.tie_word_embeddings,
                            position_embedding_type="none", visual=RadioVision(spec, frozen=freeze_vision_tower))
    if torch.cuda.is_available():
        model = model.cuda()
    return model


@torch.no_grad()
def load_omni_weights(model: OmniHybridModel, arch: HFArchitecture, model_path: str | Path) -> None:
    """Copy the published checkpoint at ``model_path`` into ``model`` on this rank."""
    from safetensors import safe_open

    from learner.hf_weights import ParallelLayout
    from learner.hybrid_weights import hybrid_shard_from_hf, weight_tensors
    from learner.radio_weights import load_radio_weights

    # not HFCheckpoint: RADIO's summary_idxs is an int64 tensor, which it refuses
    handles = [safe_open(str(f), framework="pt") for f in sorted(Path(model_path).glob("*.safetensors"))]
    where = {name: h for h in handles for name in h.keys()}

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise KeyError(f"{model_path}: the checkpoint has no tensor {name!r}")
        return where[name].get_tensor(name)

    lay = ParallelLayout.current()
    lm = lambda name: get(LM_PREFIX + name)  # noqa: E731
    for name, param in weight_tensors(model):
        if name.startswith("visual."):
            continue
        value = hybrid_shard_from_hf(name, arch, lm, lay.tp_size, lay.tp_rank, lay.ep_rank, lay.ep_size)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{name}: the checkpoint gives {tuple(value.shape)}, the model holds {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))
    load_radio_weights(model.visual, get)
