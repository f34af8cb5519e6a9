"""rollout.vllm_readback on small stand-ins of vLLM's config classes (the real ones: test_engine_vllm_kwargs.py)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rollout.vllm_readback import read_back


class Backend(enum.Enum):
    TRITON = "triton"


@dataclass
class Scheduler:
    max_num_seqs: int = 128


@dataclass
class ImageDummyOptions:  # vLLM turns a limit_mm_per_prompt count into one of these
    count: int
    width: int | None = None


@dataclass
class Multimodal:
    limit_per_prompt: dict = field(default_factory=lambda: {"image": ImageDummyOptions(2), "video": 0})


@dataclass
class Model:
    multimodal_config: Multimodal = field(default_factory=Multimodal)


@dataclass
class Kernel:
    moe_backend: Backend = Backend.TRITON


@dataclass
class Config:
    scheduler_config: Scheduler = field(default_factory=Scheduler)
    model_config: Model = field(default_factory=Model)
    kernel_config: Kernel = field(default_factory=Kernel)


def test_entries_are_found_where_vllm_files_them():
    entries = read_back(Config(), {"max_num_seqs": 128, "limit_mm_per_prompt": {"image": 2},
                                   "kernel_config": {"moe_backend": "triton"}})
    assert [(e.path, e.where, e.holds) for e in entries] == [
        ("max_num_seqs", "scheduler_config.max_num_seqs", True),
        ("limit_mm_per_prompt", "model_config.multimodal_config.limit_per_prompt", True),
        ("kernel_config.moe_backend", "kernel_config.moe_backend", True)]
    assert entries[0].line() == "vllm_kwargs.max_num_seqs=128 read back from scheduler_config.max_num_seqs"


def test_a_changed_or_unknown_value_is_reported():
    changed, unknown, other = read_back(Config(), {"max_num_seqs": 64, "no_such_argument": 1,
                                                   "limit_mm_per_prompt": {"image": 3}})
    assert not changed.holds
    assert changed.line() == ("vllm_kwargs.max_num_seqs=64 but the engine runs with "
                              "scheduler_config.max_num_seqs=128")
    assert not unknown.holds and unknown.where is None and "not read back" in unknown.line()
    assert not other.holds


def test_a_count_reads_back_from_vllms_own_multimodal_options():
    from vllm.config import MultiModalConfig  # turns each count into an ImageDummyOptions(count=...) and the like

    limits = MultiModalConfig(limit_per_prompt={"image": 2, "video": 0}).limit_per_prompt
    config = Config(model_config=Model(Multimodal(limits)))
    same, other = read_back(config, {"limit_mm_per_prompt": {"image": 2, "video": 0}}) + \
        read_back(config, {"limit_mm_per_prompt": {"image": 3}})
    assert same.holds and not other.holds
    assert other.line().endswith("model_config.multimodal_config.limit_per_prompt={'image': 2, 'video': 0}")
