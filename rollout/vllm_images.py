"""A prompt's images as vLLM takes them, named so that no cache serves features of other weights.

vLLM caches a multimodal item's processed inputs and its vision-encoder outputs under the item's identifier
(``multi_modal_uuids``, else a hash of its pixels). The encoder outputs depend on the weights, so after a
refit a cached entry would give a new request the old tower's features. Each image is therefore named by its
sha256 *and the weight version the request is sent under* (the version also salts the prefix cache,
``cache_salt``): a request after an install never finds an entry of an earlier version, and nothing has to be
cleared while requests of the old version still run (NeMo-RL's "cache not found" failure came from clearing).

Prompts carry each image's ``<|image_pad|>`` already repeated to its token count (what the learner trains on);
vLLM's processor expands a token prompt's placeholders itself, so each run goes to vLLM as one token. Nano-Omni's
processor (vLLM's ``nano_nemotron_vl``) also writes the ``<img>`` / ``</img>`` around each run itself, so those go
to vLLM removed (:class:`ImageTokens`). Audio is not supported: a prompt holding the model's audio placeholder is
refused with a clear error (vLLM would otherwise read the placeholders as text).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.images import PromptImage

IMG_START, IMG_END = "<img>", "</img>"
"""What Nano-Omni's processor (transformers' and vLLM's) writes around each image's run of ``<image>``."""


@dataclass(frozen=True)
class ImageTokens:
    """A vision-language model's image placeholder token; the tokens vLLM's processor writes around each run itself
    (``start`` / ``end``: Nano-Omni's ``<img>`` / ``</img>``, None for Qwen2.5-VL); the audio placeholder the
    engine refuses (None: the model has none)."""

    image: int
    start: int | None = None
    end: int | None = None
    audio: int | None = None


def vllm_prompt(token_ids: list[int], images: Sequence[PromptImage], version: int,
                tokens: ImageTokens | int | None) -> dict[str, Any]:
    """The vLLM prompt of ``token_ids`` and ``images`` sent under weight ``version``: the prefix cache salted by the
    version and, with images, their pixels, their versioned names and each placeholder run collapsed to one token
    (without the start / end tokens the processor writes itself). ``tokens``: the model's :class:`ImageTokens`
    (an int: the image token alone); ``ValueError`` for a prompt with the audio placeholder."""
    if isinstance(tokens, int):
        tokens = ImageTokens(tokens)
    if tokens is not None and tokens.audio is not None and tokens.audio in token_ids:
        raise ValueError(f"audio inputs are not supported: the prompt holds {token_ids.count(tokens.audio)} audio "
                         f"placeholder tokens (id {tokens.audio}); Inflight trains on text and image prompts only")
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids, "cache_salt": f"inflight-weights-v{version}"}
    if not images:
        return prompt
    if tokens is None:
        raise ValueError(f"a prompt with {len(images)} images, but the engine's model is not a vision-language model")
    from PIL import Image

    image_token_id = tokens.image
    collapsed = unwrap_runs(collapse_runs(token_ids, image_token_id), tokens)
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


def unwrap_runs(token_ids: list[int], tokens: ImageTokens) -> list[int]:
    """``token_ids`` (runs collapsed) without the ``tokens.start`` right before and the ``tokens.end`` right after
    each image token: vLLM's processor writes them itself."""
    if tokens.start is None or tokens.end is None:
        return token_ids
    n, img = len(token_ids), tokens.image
    return [t for k, t in enumerate(token_ids)
            if not (t == tokens.start and k + 1 < n and token_ids[k + 1] == img)
            and not (t == tokens.end and k > 0 and token_ids[k - 1] == img)]


def image_tokens(model_dir: str) -> ImageTokens | None:
    """The :class:`ImageTokens` of a vision-language model directory (``config.json``, and for Nano-Omni the
    tokenizer's ``<img>`` / ``</img>``); None for a text model."""
    token = image_token_id(model_dir)
    if token is None:
        return None
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg.get("model_type") != "nemotron_h_omni":
        return ImageTokens(token)
    added = _added_tokens(model_dir)
    if IMG_START not in added or IMG_END not in added:
        raise ValueError(f"{model_dir}: a nemotron_h_omni tokenizer without {IMG_START} / {IMG_END}")
    audio = cfg.get("audio_token_id", cfg.get("sound_context_token_id"))
    return ImageTokens(token, added[IMG_START], added[IMG_END], audio if isinstance(audio, int) else None)


def _added_tokens(model_dir: str) -> dict[str, int]:
    """The added (special) tokens of the directory's ``tokenizer.json``, by content."""
    data = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    return {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}


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
