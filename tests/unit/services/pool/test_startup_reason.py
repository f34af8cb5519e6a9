"""The one line an engine's start-up failure is reported by (services/pool/startup.py ``reason``)."""
from __future__ import annotations

import pydantic
import pytest

from services.pool.startup import reason


class Limits(pydantic.BaseModel):
    max_model_len: int

    @pydantic.field_validator("max_model_len")
    @classmethod
    def positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("max_model_len must be positive")
        return v


def test_a_pydantic_error_is_named_by_its_message_not_by_its_help_link():
    with pytest.raises(pydantic.ValidationError) as err:
        Limits(max_model_len=0)
    line = reason(err.value)
    assert line.startswith("ValidationError: Value error, max_model_len must be positive"), line
    assert "errors.pydantic.dev" not in line


def test_the_last_line_of_a_traceback_names_the_exception():
    assert reason(RuntimeError("Traceback:\n  File x\nValueError: bad shape\n")) == "RuntimeError: ValueError: bad shape"
    assert reason(KeyError()) == "KeyError"
