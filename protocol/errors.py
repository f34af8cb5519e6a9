"""The one error type that decoding and validation raise."""


class ProtocolError(ValueError):
    """A message could not be decoded or failed validation.

    ``path`` is the dotted field path (``trajectories[3].logprobs[17]``) and
    the message says what was expected and what arrived.
    """

    def __init__(self, path: str, expected: str, got: object):
        self.path = path
        self.expected = expected
        self.got = got
        got_s = repr(got)
        if len(got_s) > 120:
            got_s = got_s[:117] + "..."
        super().__init__(f"{path or '<message>'}: expected {expected}, got {got_s}")
