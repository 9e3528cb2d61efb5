"""Errors shared by every layer above the allocator."""


class UserError(Exception):
    """Bad input or environment. The CLI prints it as one line and exits 2, no traceback.

    The message says what was wrong, the value seen, and what to do.
    """
