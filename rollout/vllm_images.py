"""A prompt's images as vLLM takes them, named so that no cache serves features of other weights.

vLLM caches a multimodal item's processed inputs and its vision-encoder outputs under the item's identifier
(``multi_modal_uuids``, else a hash of its pixels). The encoder outputs depend on the weights, so after a
refit a cached entry would give a new request the old tower's features. Each image is therefore named by its
sha256 *and the weight version the request is sent under* (the version also salts the prefix cache,
``cache_salt``): a request after an install never finds an entry of an earlier version, and nothing has to be
cleared while requests of the old version still run (NeMo-RL's "cache not found" failure came from clearing).

Prompts carry each image's ``<|image_pad|>`` already repeated to its token count (what the learner trains on);
vLLM's processor expands a token prompt's placeholders itself, so each run goes to vLLM as one token.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from protocol.images import PromptImage


def vllm_prompt(token_ids: list[int], images: Sequence[PromptImage], version: int,
                image_token_id: int | None) -> dict[str, Any]:
    """The vLLM prompt of ``token_ids`` and ``images`` sent under weight ``version``: the prefix cache salted by the
    version and, with images, their pixels, their versioned names and each placeholder run collapsed to one token."""
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids, "cache_salt": f"inflight-weights-v{version}"}
    if not images:
        return prompt
    if image_token_id is None:
        raise ValueError(f"a prompt with {len(images)} images, but the engine's model is not a vision-language model")
    from PIL import Image

    collapsed = collapse_runs(token_ids, image_token_id)
    runs = sum(1 for t in collapsed if t == image_token_id)
    if runs != len(images):
        raise ValueError(f"a prompt with {len(images)} images has {runs} runs of the image token {image_token_id}")
    prompt["prompt_token_ids"] = collapsed
    prompt["multi_modal_data"] = {"image": [Image.fromarray(i.pixels, "RGB") for i in images]}
    prompt["multi_modal_uuids"] = {"image": [image_uuid(i.sha256, version) for i in images]}
    return prompt


def collapse_runs(token_ids: list[int], token: int) -> list[int]:
    """``token_ids`` with every run of ``token`` replaced by a single one."""
    return [t for k, t in enumerate(token_ids) if t != token or k == 0 or token_ids[k - 1] != token]


def image_token_id(model_dir: str) -> int | None:
    """The image placeholder token of a vision-language model directory (``config.json``), None for a text model."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if "vision_config" not in cfg:
        return None
    token = cfg.get("image_token_id", cfg.get("text_config", {}).get("image_token_id"))
    return token if isinstance(token, int) else None


def image_uuid(sha256: str, version: int) -> str:
    """The identifier vLLM caches an image's processed inputs and encoder outputs under."""
    return f"{sha256}-v{version}"
