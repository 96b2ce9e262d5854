"""Errors a user can fix by changing an input (a flag, a file, a mesh)."""


class UserError(ValueError):
    """A bad input; the message is one line that names the values and says what to change.
    `every_rank`: raised alike on every rank of a run (after they agreed on it), so that rank 0's
    line says it for all of them."""

    def __init__(self, message: str, *, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank
