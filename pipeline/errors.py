class DraftsmithError(Exception):
    """A user-facing problem: the CLI prints its one-line message and exits non-zero, no traceback."""
