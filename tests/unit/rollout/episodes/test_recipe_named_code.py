"""What a recipe names as code is checked to be what its key says (issue 32.2): ``env.<name>.environment`` a class
with ``reset`` and ``step``, a reward function a Python function taking the batch; anything else is refused by name
before it is built or called."""
from __future__ import annotations

from pathlib import Path

import pytest

from rollout.episodes.env_registry import load_environment_class
from rollout.rewards.registry import get_reward_fn


@pytest.mark.parametrize("where", ["subprocess:Popen", "collections:OrderedDict"])
def test_a_class_that_is_not_an_environment_is_refused(where: str):
    with pytest.raises(ValueError, match="is not an environment .no reset or step method"):
        load_environment_class(where)


def test_an_environment_class_is_accepted(tmp_path: Path):
    f = tmp_path / "env.py"
    f.write_text("class E:\n    def reset(self, task):\n        return None, []\n"
                 "    def step(self, state, turn):\n        return None\n")
    assert load_environment_class(f"{f}:E").__name__ == "E"
    assert load_environment_class("letter_relay").__name__ == "LetterRelay"


@pytest.mark.parametrize("where, words", [("subprocess:Popen", "a type, not a Python function"),
                                          ("os:system", "not a Python function"),
                                          ("operator:add", "not a Python function")])
def test_a_reward_function_that_is_a_class_or_builtin_is_refused(where: str, words: str):
    with pytest.raises(ValueError, match=words):
        get_reward_fn(where)


def test_a_reward_function_must_take_the_batch(tmp_path: Path):
    f = tmp_path / "r.py"
    f.write_text("def none():\n    return []\n\ndef two(batch, extra):\n    return []\n\n"
                 "def ok(batch, scale=1.0):\n    return [scale for _ in batch]\n\n"
                 "async def aok(batch):\n    return [1.0 for _ in batch]\n")
    for bad in ("none", "two"):
        with pytest.raises(ValueError, match="does not take one argument"):
            get_reward_fn(f"{f}:{bad}")
    assert get_reward_fn(f"{f}:ok")([]) == []
    assert get_reward_fn(f"{f}:aok").__name__ == "aok"
