"""Nemotron-3-Nano-Omni in the learner: the Nemotron-H hybrid model with the RADIO vision side inside.

:class:`OmniHybridModel` is a :class:`~learner.hybrid_model.HybridModel` (Mamba2 / attention / MLP / MoE layers, no
position embeddings) that also holds :class:`~learner.radio_tower.RadioVision` as its submodule ``visual``. Its
forward embeds the tokens with Megatron's word embedding, runs the tower on the micro-batch's images
(:class:`~learner.mrope_positions.PackedImages`, grids ``[images, 3]`` of ``(1, rows, cols)`` patches) and
scatters the image embeddings at the prompt's ``<image>`` positions, image after image, then runs the hybrid
stack on that ``decoder_input``: what transformers' ``NemotronH_Omni_Reasoning_V3.forward`` and vLLM's
``nano_nemotron_vl`` do. Nemotron-H has no RoPE, so image tokens need no positions of their own.

Weights: :mod:`learner.omni_weights` (through :mod:`learner.hf_weights` and :mod:`learner.hf_export`): the language
model from the published ``language_model.backbone.*`` / ``language_model.lm_head.weight`` (tensor-parallel shards as
for Nemotron-H), the vision side under RADIO's published names (replicated). Frozen tower by default.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from learner.config import MegatronConfig
from learner.hf_config import HFArchitecture
from learner.hybrid_model import HybridModel
from learner.mrope_positions import PackedImages
from learner.radio_tower import RadioVision

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

class OmniHybridModel(HybridModel):
    """``HybridModel`` with the vision side ``visual``; see the module docstring."""

    def __init__(self, *args: Any, visual: RadioVision, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.visual = visual

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                decoder_input: torch.Tensor | None = None, labels: torch.Tensor | None = None, *args: Any,
                images: PackedImages | None = None, **kwargs: Any) -> torch.Tensor:
        if decoder_input is None:
            decoder_input = self.embed(input_ids, position_ids, images)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels, *args, **kwargs)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, images: PackedImages | None) -> torch.Tensor:
        """``[s, b, h]`` word embeddings of ``input_ids`` with the image embeddings at ``images.token_mask``."""
        emb = self.embedding(input_ids=input_ids, position_ids=position_ids)
        if images is None:
            return emb
        grids = images.image_grid_thw
        if (grids[:, 0] != 1).any():
            raise ValueError(f"image_grid_thw {grids.tolist()}: a Nano-Omni image has one frame (t = 1)")
        feats = self.visual(images.pixel_values, grids[:, 1:])
        mask = images.token_mask
        if mask.shape != input_ids.shape or int(mask.sum()) != feats.shape[0]:
            raise ValueError(f"the micro-batch marks {int(mask.sum())} image positions (mask {tuple(mask.shape)}, "
                             f"tokens {tuple(input_ids.shape)}); its images give {feats.shape[0]} embeddings")
        return emb.transpose(0, 1).masked_scatter(mask[..., None], feats.to(emb.dtype)).transpose(0, 1)


def build_omni_model(arch: HFArchitecture, megatron: MegatronConfig, core_attention: type | None = None,
                     freeze_vision_tower: bool = True) -> tuple[OmniHybridModel, TransformerConfig]:
    """An :class:`OmniHybridModel` (random init) of a Nano-Omni ``arch``, its tower frozen unless asked, and its
    ``TransformerConfig``."""
    from learner.hybrid_model import hybrid_stack_spec, hybrid_transformer_config
    from learner.model import define_missing_te_symbols

    if megatron.pipeline_model_parallel_size > 1:
        raise ValueError("pipeline_model_parallel_size > 1: Nano-Omni needs pipeline_model_parallel_size 1")
    if arch.hybrid is None or arch.radio is None:
        raise ValueError(f"a Nano-Omni needs a Nemotron-H language model and a RADIO tower, got {arch.describe()}")
    config = hybrid_transformer_config(arch, megatron)
    if arch.is_moe:
        define_missing_te_symbols()
    model = OmniHybridModel(config=config, mamba_stack_spec=hybrid_stack_spec(arch, core_attention,
                                                                            megatron.moe_grouped_gemm),
                            vocab_size=arch.vocab_size, max_sequence_length=arch.max_position_embeddings,
                            hybrid_override_pattern=arch.hybrid.pattern, pre_process=True, post_process=True,
                            parallel_output=True, share_embeddings_and_output_weights=arch.tie_word_embeddings,
                            position_embedding_type="none",
                            visual=RadioVision(arch.radio, frozen=freeze_vision_tower))
    if torch.cuda.is_available():
        model = model.cuda()
    return model, config
