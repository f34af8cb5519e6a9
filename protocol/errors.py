"""The one error type that decoding and validation raise.

:class:`ProtocolError` names the field path of the offending value (e.g.
``trajectories[3].logprobs[17]``), what was expected and what arrived; the
value is shown through a bounded repr, so a hostile message cannot make
building the error message recurse or copy its payload.
"""

import reprlib

_GOT_REPR = reprlib.Repr()
_GOT_REPR.maxlevel = 3
_GOT_REPR.maxstring = _GOT_REPR.maxother = 80
_GOT_REPR.maxlist = _GOT_REPR.maxtuple = _GOT_REPR.maxdict = _GOT_REPR.maxset = 8
_GOT_REPR.maxlong = 40
"""Bounded repr for the offending value: a hostile message may carry a list
nested a thousand levels deep or a megabyte string, and building the error
message must neither recurse without bound nor copy the payload."""


class ProtocolError(ValueError):
    """A message could not be decoded or failed validation.

    ``path`` is the dotted field path (``trajectories[3].logprobs[17]``) and
    the message says what was expected and what arrived.
    """

    def __init__(self, path: str, expected: str, got: object):
        self.path = path
        self.expected = expected
        self.got = got
        got_s = _GOT_REPR.repr(got)
        if len(got_s) > 120:
            got_s = got_s[:117] + "..."
        super().__init__(f"{path or '<message>'}: expected {expected}, got {got_s}")
