"""Errors a user can fix. The CLI prints their message as one line and exits 2."""


class UserError(ValueError):
    """Bad input: the message names what is wrong and what would work."""
