"""The whole NeMo-RL table: one rule per NeMo-RL key (or ``prefix.*``), composed from one table per concern.

``policy.*`` is in :mod:`.table_policy`; ``grpo.*`` and ``loss_fn.*`` in :mod:`.table_algorithm`; ``data.*`` and
``env.*`` in :mod:`.table_data`; ``logger.*``, ``checkpointing.*``, ``cluster.*`` and the other top-level sections
in :mod:`.table_run`. A path belongs to one table only (checked at import).
"""
from __future__ import annotations

from services.recipe.nemo_rl.rules import Table
from services.recipe.nemo_rl.table_algorithm import ALGORITHM_RULES
from services.recipe.nemo_rl.table_data import DATA_RULES
from services.recipe.nemo_rl.table_policy import POLICY_RULES
from services.recipe.nemo_rl.table_run import RUN_RULES

PARTS: dict[str, Table] = {"policy": POLICY_RULES, "algorithm": ALGORITHM_RULES, "data": DATA_RULES,
                           "run": RUN_RULES}


def _compose() -> Table:
    table: dict = {}
    for name, part in PARTS.items():
        for path, rule in part.items():
            if path in table:
                raise AssertionError(f"NeMo-RL rule for {path} is in two tables (the second: {name})")
            table[path] = rule
    return table


TABLE: Table = _compose()
"""Every rule, by exact path or ``prefix.*`` pattern."""
