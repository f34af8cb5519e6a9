"""A vision-language policy: the model's own vision tower inside a Megatron-Core ``GPTModel`` with mrope.

:class:`VisionLanguageGPT` is a ``GPTModel`` (multimodal rotary positions, ``position_ids`` ``[3, b, s]``)
that also holds the checkpoint's vision tower as its submodule ``visual``. Its forward embeds the tokens
with Megatron's word embedding, runs the tower on the micro-batch's ``pixel_values`` and scatters the
merged image embeddings at the prompt's image-token positions, then runs the language model on that
``decoder_input`` — what transformers' ``Qwen2_5_VLModel.forward`` and vLLM do.

The tower is transformers' own module for the family (Qwen2.5-VL:
``Qwen2_5_VisionTransformerPretrainedModel``, windowed attention, 2-D rotary patches, patch merger), built
from the ``vision_config`` of ``config.json`` (:func:`build_vision_tower`) and loaded from the checkpoint's
``visual.*`` tensors under their own names (:mod:`learner.hf_weights`). Megatron-Core 0.16.1 has no
Qwen2.5-VL encoder (its vision models are CLIP / RADIO ViTs), and its own ``HuggingFaceModule`` wraps
transformers modules the same way. The tower is replicated on every tensor-parallel rank (never sharded).

Frozen (``policy.freeze_vision_tower``, the default, as NeMo-RL's VLM recipes): :meth:`freeze_vision_tower`
takes its parameters out of training (``requires_grad`` off: no DDP buffer, no optimizer state, no
gradient), keeps it in eval mode and runs it without a graph. Trained: its parameters are the model's like
any other, in DDP's buffers and Megatron's optimizer. Details: docs/multimodal_learner.md.
"""
from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from learner.hf_config import VisionSpec
from learner.mrope_positions import PackedImages

_TOWERS = {"qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                          "Qwen2_5_VisionTransformerPretrainedModel",
                          "transformers.models.qwen2_5_vl.configuration_qwen2_5_vl", "Qwen2_5_VLVisionConfig")}
"""model_type → (module, tower class, config module, vision config class) of transformers."""


def build_vision_tower(model_type: str, spec: VisionSpec) -> torch.nn.Module:
    """transformers' vision tower of ``model_type`` from ``spec.config`` (random init, float32, SDPA attention)."""
    import importlib

    if model_type not in _TOWERS:
        raise ValueError(f"model_type {model_type!r} has no vision tower here (supported: {', '.join(_TOWERS)})")
    module, cls, config_module, config_cls = _TOWERS[model_type]
    config = getattr(importlib.import_module(config_module), config_cls)(**spec.config)
    tower_cls = getattr(importlib.import_module(module), cls)
    return tower_cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)


class VisionLanguageGPT(GPTModel):
    """``GPTModel`` with mrope and the vision tower ``visual``; see the module docstring."""

    def __init__(self, *args: Any, visual: torch.nn.Module, vision_spec: VisionSpec, frozen_tower: bool,
                 **kwargs: Any):
        """``GPTModel``'s arguments, the tower ``visual`` of ``vision_spec`` and whether it is frozen."""
        super().__init__(*args, **kwargs)
        self.visual = visual
        self.vision_spec = vision_spec
        self.vision_frozen = False
        if frozen_tower:
            self.freeze_vision_tower()

    def freeze_vision_tower(self) -> None:
        """No gradient, no optimizer state, eval mode for the tower from now on."""
        self.vision_frozen = True
        self.visual.requires_grad_(False)
        self.visual.eval()

    def train(self, mode: bool = True) -> VisionLanguageGPT:
        super().train(mode)
        if self.vision_frozen:
            self.visual.eval()
        return self

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                decoder_input: torch.Tensor | None = None, labels: torch.Tensor | None = None, *args: Any,
                images: PackedImages | None = None, **kwargs: Any) -> torch.Tensor:
        """``GPTModel.forward`` on the embeddings of :meth:`embed`; 2-D ``position_ids`` (text only) are the same
        positions on all three mrope axes."""
        if position_ids.dim() == 2:
            position_ids = position_ids[None].expand(3, -1, -1)
        if decoder_input is None:
            decoder_input = self.embed(input_ids, position_ids, images)
        # Megatron annotates labels `Tensor = None`: None is its own default
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels,  # pyright: ignore[reportArgumentType]
                               *args, **kwargs)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
              images: PackedImages | None) -> torch.Tensor:
        """``[s, b, h]`` word embeddings of ``input_ids`` with the tower's image embeddings at ``images.token_mask``."""
        emb = self.embedding(input_ids=input_ids, position_ids=position_ids)
        if images is None:
            return emb
        dtype = next(self.visual.parameters()).dtype
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.vision_frozen):
            feats = self.visual(images.pixel_values.to(dtype), grid_thw=images.image_grid_thw).pooler_output
        mask = images.token_mask
        if mask.shape != input_ids.shape or int(mask.sum()) != feats.shape[0]:
            raise ValueError(f"the micro-batch marks {int(mask.sum())} image positions (mask {tuple(mask.shape)}, "
                             f"tokens {tuple(input_ids.shape)}); its images give {feats.shape[0]} embeddings")
        # [b, s, h] order, as transformers scatters: image after image, token after token
        return emb.transpose(0, 1).masked_scatter(mask[..., None], feats.to(emb.dtype)).transpose(0, 1)
