"""Errors a user can fix. The CLI prints them as one line and exits with status 2."""


class UserError(ValueError):
    """Bad input from the user (a flag, a file, a folder). The message says what and what to do."""
