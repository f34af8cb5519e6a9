"""Exactly-once accounting of prompts (services/job/ledger.py)."""
from __future__ import annotations

import pytest

from services.job.ledger import LedgerError, LedgerSummary, PromptLedger


def test_ledger_exactly_once():
    led = PromptLedger()
    led.schedule("a", 1)
    led.schedule("b", 1)
    led.mark_trained("a", 1)
    led.mark_dropped("b", "stale")
    with pytest.raises(LedgerError, match="already trained"):
        led.mark_trained("a", 2)
    with pytest.raises(LedgerError, match="already dropped"):
        led.mark_trained("b", 2)
    with pytest.raises(LedgerError, match="never scheduled"):
        led.mark_dropped("c", "x")
    with pytest.raises(LedgerError, match="scheduled twice"):
        led.schedule("a", 3)
    assert led.summary() == LedgerSummary(scheduled=2, trained=1, dropped=1, pending=0, dropped_by_reason={"stale": 1})
    assert led.summary().line() == "2 scheduled, 1 trained, 1 dropped (stale 1), 0 pending"
    assert PromptLedger().summary().line() == "0 scheduled, 0 trained, 0 dropped, 0 pending"
    assert PromptLedger.from_state(led.state()).summary() == led.summary()
