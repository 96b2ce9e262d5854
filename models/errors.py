"""Errors a user can fix by changing an input (a flag, a file, a mesh)."""


class UserError(ValueError):
    """A bad input; the message is one line that names the values and says what to change."""
