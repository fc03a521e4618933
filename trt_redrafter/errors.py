"""User-facing errors.

A `UserError` is something the user can fix (a missing file, a wrong flag, a model that does not fit the
requested TP size). Its message is one sentence: what is wrong, where, and what to do. The CLI prints it and
exits with status 2; internal invariants stay `assert`s with values.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """An error caused by input the user controls; the CLI prints it and exits with status 2."""


def require(cond: bool, message: str) -> None:
    """Raise `UserError(message)` unless `cond` holds."""
    if not cond:
        raise UserError(message)


class ServerBusy(UserError):
    """A request refused at admission because `max_queue_size` requests are already waiting (retry later)."""
