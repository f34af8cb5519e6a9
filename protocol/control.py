"""Out-of-band notes on the trajectory channel (:class:`ControlMessage`), e.g. an engine reporting a prompt it
could not turn into a group."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from protocol import fields as F
from protocol.errors import ProtocolError

CONTROL_ACTIONS = ("error",)
"""The actions anything sends: ``error`` (an engine reports a prompt it could not turn into a group)."""


@dataclass
class ControlMessage:
    """A small out-of-band note on the trajectory channel, e.g. ``error``: prompt ``payload["prompt_id"]``
    failed for ``payload["reason"]``."""

    KIND: ClassVar[str] = "control"
    action: Literal["error"]
    payload: dict = field(default_factory=dict)
    sent_at: float = 0.0

    def to_wire(self) -> dict:
        return {"action": self.action, "payload": dict(self.payload), "sent_at": self.sent_at}

    @classmethod
    def from_wire(cls, d: dict, path: str = "") -> ControlMessage:
        action = F.as_str(F.req(d, "action", path), F._join(path, "action"))
        if action not in CONTROL_ACTIONS:
            raise ProtocolError(F._join(path, "action"), f"one of {CONTROL_ACTIONS}", action)
        payload = F.as_dict(F.req(d, "payload", path), F._join(path, "payload"))
        for k, v in payload.items():
            if not isinstance(v, (str, int, float, bool, type(None))):
                raise ProtocolError(f"{F._join(path, 'payload')}.{k}", "a scalar", type(v).__name__)
            if isinstance(v, float):
                F.as_float(v, f"{F._join(path, 'payload')}.{k}")
        sent_at = F.as_float(F.req(d, "sent_at", path), F._join(path, "sent_at"))
        return cls(action, payload, sent_at)
