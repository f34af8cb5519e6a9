"""Base class for the typed configuration models of every package.

Unknown keys are errors, values are checked at load, and the docstring under
each field becomes its description (shown by ``inflight validate --explain``).
It lives in ``protocol`` because every package may import it.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigModel(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              frozen=False, protected_namespaces=())
