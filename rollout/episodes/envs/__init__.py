"""Example environments (docs/environments.md, "Example environments"): :class:`LetterRelay`, a multi-turn
game a random tiny model learns on CPU, and :class:`CalculatorArithmetic`, multi-step arithmetic with the
calculator tool. Their prompt sets are ``letter_relay`` and ``multi_step_arithmetic`` (services/data/tasks.py)."""
from __future__ import annotations

from rollout.episodes.envs.arithmetic import CalculatorArithmetic
from rollout.episodes.envs.letter_relay import LetterRelay, RelayState

__all__ = ["CalculatorArithmetic", "LetterRelay", "RelayState"]
