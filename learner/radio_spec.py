"""Nemotron-3-Nano-Omni's vision side as its ``config.json`` describes it (no torch: :mod:`learner.hf_config` reads it).

:class:`RadioSpec` holds what the learner's RADIO tower (:mod:`learner.radio_tower`) and the packing of image
micro-batches need: the RADIO config, the widths of the tower, projector and language model, the pixel-shuffle
ratio, the image placeholder and the normalisation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODEL_TYPE = "nemotron_h_omni"


@dataclass(frozen=True)
class RadioSpec:
    """The vision side of a ``nemotron_h_omni`` ``config.json``."""

    vision_config: dict[str, Any]
    """``vision_config`` as it is (transformers' ``RadioConfig`` fields; vLLM's ``args`` are dropped)."""
    vision_hidden_size: int
    projector_hidden_size: int
    text_hidden_size: int
    downsample_ratio: float
    image_token_id: int
    norm_mean: tuple[float, float, float]
    norm_std: tuple[float, float, float]

    @property
    def patch_size(self) -> int:
        return int(self.vision_config.get("patch_size", 16))

    @property
    def merge(self) -> int:
        """Patches a side that the pixel shuffle merges into one token (2 for a ratio of 0.5)."""
        return round(1 / self.downsample_ratio)

    def tokens(self, grid_hw: tuple[int, int]) -> int:
        """Image tokens of an image of ``grid_hw`` patches."""
        return grid_hw[0] * grid_hw[1] // self.merge ** 2

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> RadioSpec:
        """The spec of a ``config.json`` (published key names accepted too); ``ValueError`` naming what is missing."""
        if cfg.get("model_type") != MODEL_TYPE:
            raise ValueError(f"model_type: expected {MODEL_TYPE!r}, got {cfg.get('model_type')!r}")
        text = cfg.get("text_config") or cfg.get("llm_config")
        vision = cfg.get("vision_config")
        if not isinstance(text, dict) or not isinstance(vision, dict):
            raise ValueError("a nemotron_h_omni config.json needs text_config and vision_config mappings")
        if int(text.get("num_nextn_predict_layers") or 0) > 0:
            raise ValueError("text_config.num_nextn_predict_layers > 0 (a vision_final_layernorm the checkpoint does "
                             "not store): not supported by the learner's Nano-Omni tower")
        image_token = cfg.get("image_token_id", cfg.get("img_context_token_id"))
        if not isinstance(image_token, int):
            raise ValueError("a nemotron_h_omni config.json needs image_token_id (or img_context_token_id)")
        ratio = float(cfg.get("downsample_ratio", 0.5))
        if round(1 / ratio) * ratio != 1:
            raise ValueError(f"downsample_ratio: expected 1/n, got {ratio}")
        return cls(vision_config={k: v for k, v in vision.items() if k not in ("args", "preferred_resolution",
                                                                                 "separate_video_embedder")},
                   vision_hidden_size=int(cfg.get("vision_hidden_size", cfg.get("vit_hidden_size", 1280))),
                   projector_hidden_size=int(cfg.get("projector_hidden_size", 4096)),
                   text_hidden_size=int(text["hidden_size"]), downsample_ratio=ratio, image_token_id=image_token,
                   norm_mean=tuple(cfg.get("norm_mean", vision.get("norm_mean"))),  # type: ignore[arg-type]
                   norm_std=tuple(cfg.get("norm_std", vision.get("norm_std"))))  # type: ignore[arg-type]
