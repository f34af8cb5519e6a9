"""Nemotron-3-Nano-Omni (``nemotron_h_omni``) on vLLM's ``nano_nemotron_vl``: the measured incompatibilities and
their fixes.

1. transformers 5.19 reads the published ``config.json`` with its own ``nemotron_h_omni`` config class, which renames
   the published keys (``vit_hidden_size`` becomes ``vision_hidden_size``, ``llm_config`` ``text_config``...).
   vLLM 0.32's model still reads ``config.vit_hidden_size`` and fails at construction ("'NemotronH_Omni_Reasoning_V3_
   Config' object has no attribute 'vit_hidden_size'"). :func:`hf_overrides` gives it back through vLLM's own
   ``hf_overrides`` engine argument.
2. vLLM 0.32's ``extract_feature_dynamic`` casts the RADIO features to bfloat16 whatever the model's dtype, so a
   float32 engine fails in the projector ("expected m1 and m2 to have the same dtype, but got: c10::BFloat16 !=
   float"). :func:`patch_vllm` (called by the ``vllm.general_plugins`` entry point, :mod:`rollout.cpu_moe_plugin`)
   casts to the language model's dtype instead: the same in a bfloat16 engine. vLLM builds the tower in the dtype of
   ``text_config.dtype`` (``llm_dtype``), not the engine's, while the pixels come in the engine's: a bfloat16 engine
   on a float32 checkpoint failed in the patch embedder with the same message. The patch casts the pixels to the
   tower's dtype.

3. vLLM 0.25.1 (the GPU hosts') does not know transformers 5.19's architecture name ``NemotronH_Omni_Reasoning_V3``;
   :func:`hf_overrides` names :data:`VLLM_CLASS` instead where the installed vLLM lacks it.

4. vLLM 0.32's ``load_weights`` loads the projector (``mlp1``, and ``vision_final_layernorm`` where the model has
   one) with ``default_weight_loader`` called directly, past the loaders that ``reload_weights``' layerwise reload
   puts on each parameter; that reload then finds nothing loaded for those layers and keeps their old tensors ("Linear:
   Failed to load weights"). :func:`install_projector` copies the push's projector tensors in after every install,
   whichever path installed it.

5. vLLM's image processor for the model (``transformers_utils/processors/nano_nemotron_vl.py``, 0.32 and 0.25.1)
   resizes with ``_bicubic_resize_and_normalize`` under ``torch.compile(dynamic=True)``: inductor compiles C++ for
   it on the first image, inside ``AsyncLLM.add_request`` on the engine actor's event loop. The H100's first image
   request took 90 s and the actor missed two health checks; here the first call takes 3.6 s, eager 1 ms.
   :func:`patch_vllm` puts the uncompiled function back (the same arithmetic: it is what ``torch.compile`` wraps).
   The engine calls it in its own process too (:meth:`rollout.engine.RolloutEngine.start`): the entry point that
   vLLM's plugins come from exists only where Inflight is installed, and the GPU hosts run it from the source tree
   (its first image request there still took 70 s with the fix reached only through the entry point).

Audio (the Parakeet encoder) is not supported: ``limit_mm_per_prompt`` gives it 0 items and
:mod:`rollout.vllm_images` refuses a prompt holding the audio placeholder.
"""
from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

MODEL_TYPE = "nemotron_h_omni"
VLLM_CLASS = "NemotronH_Nano_VL_V2"
"""vLLM's model class for Nano-Omni (``nano_nemotron_vl``)."""
PROJECTOR_PREFIXES = ("mlp1.", "vision_projector.vision_final_layernorm.")
"""The published names of the projector's tensors, as a push names them."""


def is_nano_omni(model_path: str) -> bool:
    """Whether ``model_path``'s ``config.json`` is a Nano-Omni (False when it cannot be read)."""
    try:
        return json.loads((Path(model_path) / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError):
        return False


def hf_overrides(model_path: str, supported: Collection[str] | None = None) -> dict[str, Any]:
    """The config keys vLLM's ``nano_nemotron_vl`` reads under their published names, which transformers renamed; and
    ``architectures`` as :data:`VLLM_CLASS` when the installed vLLM does not know the config's own name (``supported``:
    its registry's architectures, read from vLLM when not given). vLLM 0.25.1 refused transformers 5.19's name on
    the H200: "Model architectures ['NemotronH_Omni_Reasoning_V3'] are not supported for now" (0.32 knows it); both
    register :data:`VLLM_CLASS` for the same model class."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    hidden = cfg.get("vit_hidden_size", cfg.get("vision_hidden_size"))
    if not isinstance(hidden, int):
        raise ValueError(f"{model_path}/config.json: a {MODEL_TYPE} without vit_hidden_size or vision_hidden_size")
    overrides: dict[str, Any] = {"vit_hidden_size": hidden}
    if supported is None:
        from vllm.model_executor.models import ModelRegistry

        supported = ModelRegistry.get_supported_archs()
    if not any(arch in supported for arch in cfg.get("architectures") or ()):
        overrides["architectures"] = [VLLM_CLASS]
    return overrides


def patch_vllm() -> None:
    """Make ``NemotronH_Nano_VL_V2.extract_feature_dynamic`` keep the model's dtype (fix 2 of the module docstring)
    and the image processor's resize run eagerly (fix 5). Idempotent; nothing when vLLM has no ``nano_nemotron_vl``."""
    try:
        from vllm.model_executor.models import nano_nemotron_vl
        from vllm.transformers_utils.processors import nano_nemotron_vl as processor
    except ImportError:
        return
    resize = processor._bicubic_resize_and_normalize  # pyright: ignore[reportPrivateUsage]
    processor._bicubic_resize_and_normalize = getattr(resize, "_torchdynamo_orig_callable", resize)
    cls = nano_nemotron_vl.NemotronH_Nano_VL_V2
    if getattr(cls.extract_feature_dynamic, "inflight_dtype_fix", False):
        return

    def extract_feature_dynamic(self, pixel_values, imgs_sizes):
        tower_dtype = next(self.vision_model.parameters()).dtype  # text_config.dtype, not the engine's dtype
        _, vit_embeds = self.vision_model(pixel_values.to(tower_dtype), imgs_sizes=imgs_sizes)
        vit_embeds = vit_embeds.to(dtype=self.llm_dtype)  # vLLM 0.32: torch.bfloat16
        if (final_norm := getattr(self, "vision_final_layernorm", None)) is not None:  # vLLM 0.25.1 has none
            vit_embeds = final_norm(vit_embeds)
        vit_embeds = self.pixel_shuffle_dynamic_res(vit_embeds, imgs_sizes=imgs_sizes)
        return self.mlp1(vit_embeds)

    extract_feature_dynamic.inflight_dtype_fix = True  # pyright: ignore[reportFunctionMemberAccess]
    cls.extract_feature_dynamic = extract_feature_dynamic


def is_vllm_nano_omni(model: Any) -> bool:
    """Whether ``model`` (a vLLM worker's model) is Nano-Omni, whose installs need :func:`install_projector`."""
    return type(model).__name__ == VLLM_CLASS


def install_projector(model: Any, tensors: Iterable[tuple[str, Any]]) -> list[str]:
    """Copy the projector tensors among ``tensors`` (published names) into a vLLM Nano-Omni ``model`` (fix 4 of the
    module docstring); returns the names copied (none for another model)."""
    import torch

    if not is_vllm_nano_omni(model):
        return []
    params = {f"mlp1.{k}": p for k, p in model.mlp1.named_parameters()}
    if (final_norm := getattr(model, "vision_final_layernorm", None)) is not None:  # vLLM 0.25.1 has none
        params.update({f"{PROJECTOR_PREFIXES[1]}{k}": p for k, p in final_norm.named_parameters()})
    done = []
    with torch.no_grad():
        for name, tensor in tensors:
            param = params.get(name)
            if param is None:
                continue
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: pushed shape {tuple(tensor.shape)}, the engine's {tuple(param.shape)}")
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
            done.append(name)
    return done
