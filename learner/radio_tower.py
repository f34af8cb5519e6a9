"""Nemotron-3-Nano-Omni's vision side for the learner: the RADIO ViT, the pixel shuffle and the MLP projector.

:class:`RadioVision` turns a prompt's images, given as RADIO's packed input (each image's normalised, channel-major
16 x 16 patches in row-major order, concatenated; ``image_grid_hw`` the patch grid of each), into one embedding per
image token: the ViT's patch features (class and register tokens dropped), a 0.5 pixel shuffle (2 x 2 neighbouring
patches into one vector of four times the width) and the projector (RMSNorm, linear, squared ReLU, linear) to the
language model's width. An image of ``h x w`` patches gives ``h * w / 4`` tokens, the run of ``<image>`` that
the model's processor writes between ``<img>`` and ``</img>``.

The ViT and the projector are transformers' own modules of the family (``RadioModel`` with its input conditioner
external, as ``NemotronH_Omni_Reasoning_V3`` builds it; ``NemotronH_Omni_Reasoning_V3MultiModalProjector``), built from
``config.json`` (:class:`RadioSpec`) in float32 with SDPA attention: Megatron-Core 0.16.1's RADIO ViT needs
Transformer Engine. Frozen by default (``requires_grad`` off, eval mode), as the seed's recipes; trainable otherwise.
Weights under the published names: :mod:`learner.radio_weights`.
"""
from __future__ import annotations

from typing import Any

import torch

from learner.radio_spec import RadioSpec


class RadioVision(torch.nn.Module):
    """``vision_model`` (RADIO) + ``multi_modal_projector``; see the module docstring."""

    def __init__(self, spec: RadioSpec, frozen: bool = True):
        from transformers import RadioConfig, RadioModel
        from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import (
            NemotronH_Omni_Reasoning_V3MultiModalProjector as Projector,
        )

        super().__init__()
        self.spec = spec
        config = RadioConfig(**spec.vision_config)
        self.vision_model = RadioModel._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        self.vision_model.make_preprocessor_external()
        self.multi_modal_projector = Projector(spec.vision_hidden_size * spec.merge ** 2, spec.projector_hidden_size,
                                               spec.text_hidden_size)
        self.frozen = False
        if frozen:
            self.freeze()

    def freeze(self) -> None:
        """No gradient, no optimizer state, eval mode from now on."""
        self.frozen = True
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> RadioVision:
        return super().train(mode and not self.frozen)

    def pixel_shuffle(self, features: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """``[rows * cols, c]`` patch features -> ``[rows * cols / m^2, c * m^2]`` (transformers' and vLLM's v2)."""
        m = self.spec.merge
        x = features.view(1, rows, cols // m, -1)
        x = x.transpose(1, 2).contiguous().view(1, cols // m, rows // m, -1).transpose(1, 2).contiguous()
        return x.flatten(0, 2)

    def forward(self, pixel_values: torch.Tensor, image_grid_hw: torch.Tensor) -> torch.Tensor:
        """``[image tokens, text hidden]`` of the packed images (image after image, row-major in each)."""
        grids = [(int(h), int(w)) for h, w in image_grid_hw.tolist()]
        if sum(h * w for h, w in grids) != pixel_values.shape[0]:
            raise ValueError(f"pixel_values holds {pixel_values.shape[0]} patches, image_grid_hw describes "
                             f"{sum(h * w for h, w in grids)}")
        if any(h % self.spec.merge or w % self.spec.merge for h, w in grids):
            raise ValueError(f"image_grid_hw {grids}: each side must be a multiple of {self.spec.merge}")
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            dtype = next(self.vision_model.parameters()).dtype  # float32, or bf16 under Float16Module
            features = self.vision_model(pixel_values.to(dtype), image_grid_hw=image_grid_hw).features
            parts = features.split([h * w for h, w in grids])
            shuffled = torch.cat([self.pixel_shuffle(f, h, w) for f, (h, w) in zip(parts, grids, strict=True)])
            return self.multi_modal_projector(shuffled)


def radio_patches(image: Any, spec: RadioSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``(h, w, 3)`` uint8 image (sides multiples of ``patch_size * merge``, already at the size the processor
    chose) as RADIO's packed input: normalised channel-major patches, row-major, and its ``[1, 2]`` patch grid."""
    p = spec.patch_size
    x = torch.as_tensor(image).float() / 255
    x = (x - torch.tensor(spec.norm_mean)) / torch.tensor(spec.norm_std)
    rows, cols = x.shape[0] // p, x.shape[1] // p
    if rows * p != x.shape[0] or cols * p != x.shape[1]:
        raise ValueError(f"image of {tuple(x.shape[:2])} pixels: sides must be multiples of {p}")
    x = x.permute(2, 0, 1).reshape(3, rows, p, cols, p).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3 * p * p)
    return x, torch.tensor([[rows, cols]])
