"""The prompt stream: a fixed prompt set in a seeded order, epoch after epoch.

``next(n, step)`` returns ``n`` :class:`PromptRequest` s scheduled for
``step``. Each one gets a unique id ``<prompt id>@<epoch>`` so the ledger can
tell repeats of a prompt in later epochs apart. The position (epoch, index)
is saved in checkpoints so a resumed run continues where it stopped.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from protocol import PromptRequest

if TYPE_CHECKING:
    from services.config import Recipe


@dataclass
class PromptSource:
    prompts: list[PromptRequest]
    seed: int
    epoch: int = 0
    index: int = 0

    @classmethod
    def of_task(cls, recipe: Recipe, model_path: str) -> PromptSource:
        """The prompts of ``env.task`` (``env.num_prompts`` of them, tokenized by the model's tokenizer), in the
        order of ``grpo.seed``."""
        from transformers import AutoTokenizer

        from rollout.tasks import make_prompts

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        seed = recipe.grpo.seed
        return cls(make_prompts(recipe.env.task, tokenizer, recipe.env.num_prompts, seed), seed)

    def __post_init__(self):
        if not self.prompts:
            raise ValueError("prompt source: the prompt set is empty")
        self._order = self._shuffled(self.epoch)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 100_003 + epoch).shuffle(order)
        return order

    def next(self, n: int, step: int) -> list[PromptRequest]:
        out = []
        for _ in range(n):
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            p = self.prompts[self._order[self.index]]
            self.index += 1
            out.append(replace(p, prompt_id=f"{p.prompt_id}@{self.epoch}", scheduled_step=step))
        return out

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, position: dict) -> None:
        self.epoch, self.index = int(position["epoch"]), int(position["index"])
        self._order = self._shuffled(self.epoch)
