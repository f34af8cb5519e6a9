"""NeMo-RL's named datasets (``data.train.dataset_name``, ``data.validation.dataset_name``) as Hugging Face Hub
datasets with Inflight's column mapping, read from NeMo-RL's registry
(``nemo_rl/data/datasets/response_datasets/__init__.py`` and each dataset's class).

NeMo-RL's classes turn a row into ``messages: [user: <problem>, assistant: <answer>]``, which its
``math_hf_data_processor`` reads back as the prompt text and the reward's ground truth, and drop every other
column. Here the same columns are named directly: ``input_key`` (the prompt text, a dotted path into nested
columns where the set nests it) and ``output_key`` (the reference), with ``task_columns: []`` (no other column
reaches the reward, as in NeMo-RL). The Hub is read when the run starts, never by ``inflight validate``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.recipe.nemo_rl.rules import TranslationError


@dataclass(frozen=True)
class HubDataset:
    """One NeMo-RL dataset: where it is on the Hub and which columns hold the prompt and the answer."""

    hub_id: str
    """``<owner>/<name>`` on the Hugging Face Hub."""
    default_split: str
    """The split NeMo-RL's class loads when the recipe names none."""
    input_key: str
    output_key: str
    splits: tuple[str, ...] = ()
    """The splits its class accepts (``data.<which>.split``); empty: it takes no ``split`` key."""
    split_hub_ids: tuple[tuple[str, str], ...] = ()
    """Splits that are separate Hub datasets (split -> hub id, whose ``train`` split it is)."""
    output_key_option: bool = False
    """Whether its class takes ``output_key`` from the recipe (OpenMathInstruct-2 does)."""
    holds_out: float | None = None
    """``split_validation_size`` when the class supports a hold-out: its default; None: the class ignores the key."""
    image_key: str | None = None
    """The column holding each row's image (a ``datasets.Image``): a vision-language set, read with NeMo-RL's
    ``vlm_hf_data_processor``; None: a text set, read with ``math_hf_data_processor``."""

    def source(self, split: str | None) -> tuple[str, str]:
        """(``hf://`` path, split) of split ``split`` (None: the default one)."""
        split = split or self.default_split
        for name, hub_id in self.split_hub_ids:
            if name == split:
                return f"hf://{hub_id}", "train"
        return f"hf://{self.hub_id}", split


NEMO_RL_DATASETS: dict[str, HubDataset] = {
    "OpenMathInstruct-2": HubDataset("nvidia/OpenMathInstruct-2", "train_1M", "problem", "expected_answer",
                                     splits=("train", "train_1M", "train_2M", "train_5M"), output_key_option=True,
                                     holds_out=0.05),
    "DAPOMath17K": HubDataset("BytedTsinghua-SIA/DAPO-Math-17k", "train", "prompt.0.content",
                              "reward_model.ground_truth"),
    "DAPOMathAIME2024": HubDataset("BytedTsinghua-SIA/AIME-2024", "train", "prompt.0.content",
                                   "reward_model.ground_truth"),
    "AIME2024": HubDataset("HuggingFaceH4/aime_2024", "train", "problem", "answer"),
    "DeepScaler": HubDataset("agentica-org/DeepScaleR-Preview-Dataset", "train", "problem", "answer"),
    # CLEVRCoGenTDataset (clevr.py): the user turn is the image then ``problem``; the answer is ``solution``'s
    # <answer> span (the exact_alnum reward reads a tagged ground truth the same way)
    "clevr-cogent": HubDataset("MMInstruction/Clevr_CoGenT_TrainA_70K_Complex", "train", "problem", "solution",
                               splits=("train", "valA", "valB"),
                               split_hub_ids=(("train", "MMInstruction/Clevr_CoGenT_TrainA_70K_Complex"),
                                              ("valA", "MMInstruction/Clevr_CoGenT_ValA"),
                                              ("valB", "MMInstruction/Clevr_CoGenT_ValB")),
                               image_key="image"),
}
"""The NeMo-RL dataset names Inflight reads, with their Hub ids, splits and columns."""

IMAGE_DATASETS = {
    "geometry3k": "hiyouga/geometry3k",
    "refcoco": "jxu124/refcoco",
}
"""NeMo-RL's other vision-language datasets: their columns are not mapped here yet."""

RESPONSE_DATASET = "ResponseDataset"
"""NeMo-RL's dataset of a ``data_path`` (a local file or a Hub id) with ``input_key`` / ``output_key``."""
RESPONSE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
"""Local file kinds that both NeMo-RL's ``ResponseDataset`` and Inflight read."""


def known_names() -> str:
    """The dataset names a NeMo-RL recipe may use here, for error messages."""
    return ", ".join([*NEMO_RL_DATASETS, RESPONSE_DATASET + " (with data_path)"])


def hub_dataset(name: str, key: str) -> HubDataset:
    """The dataset called ``name``; ``ValueError`` (naming ``key``) for an image set or an unknown name."""
    if name in NEMO_RL_DATASETS:
        return NEMO_RL_DATASETS[name]
    if name in IMAGE_DATASETS:
        raise ValueError(f"{name!r} is a vision-language dataset (Hub: {IMAGE_DATASETS[name]}): NeMo-RL's "
                         f"vision-language datasets other than clevr-cogent are not translated (Inflight reads "
                         f"images from its own data.image_key rows: docs/multimodal.md); expected one of "
                         f"{known_names()}")
    raise ValueError(f"{name!r} is not a NeMo-RL dataset Inflight knows; expected one of {known_names()}")


VLM_ENVS = ("vlm", "clevr-cogent", "geometry3k", "refcoco")
"""NeMo-RL's vision-language environment (``VLMEnvironment``) and the task names its recipes give it."""
VLM_REWARDS = {"format": "tag_format", "exact_alnum": "exact_alnum"}
"""NeMo-RL's VLM reward names -> Inflight's functions of the same scores (rollout/rewards/tag_rewards.py)."""


def vlm_rewards(path: str, value: Any) -> list[dict[str, Any]]:
    """NeMo-RL's VLM ``reward_functions`` (``[{name, weight, kwargs}]``) as Inflight's."""
    if not isinstance(value, list) or not value:
        raise TranslationError(path, f"expected a non-empty list of {{name, weight}}, got {value!r}")
    out = []
    for i, f in enumerate(value):
        name = f.get("name") if isinstance(f, dict) else None
        if name not in VLM_REWARDS:
            raise TranslationError(f"{path}.{i}.name", f"{name!r}: expected one of {', '.join(VLM_REWARDS)} (NeMo-RL's "
                                                       f"math_expr, bbox_giou and geo3k have no counterpart here)")
        if f.get("kwargs"):
            raise TranslationError(f"{path}.{i}.kwargs", f"{f['kwargs']!r}: Inflight's {VLM_REWARDS[name]} reads the "
                                                         f"<think>/<answer> tags only (expected null)")
        out.append({"name": VLM_REWARDS[name], "weight": f.get("weight", 1.0)})
    return out
