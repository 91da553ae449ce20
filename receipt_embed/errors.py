"""The one base class of "bad input" errors.

Everything a user hands over (a file, a manifest row, a config value, a plugin, an output
dir) that cannot be used raises a :class:`BadInput` naming what and where; the command line
prints that one line and exits 2. Every other exception that reaches the command line is a
bug, in receipt-embed or in a plugin, and reads as one: exit 1, a short message, and a hint
to rerun with ``--debug`` for the traceback. ``BadInput`` is a ``ValueError``, so library
callers that catch ``ValueError`` keep working.
"""

from __future__ import annotations


class BadInput(ValueError):
    """Something handed over cannot be used; the message says what and where (exit code 2)."""


class ComponentError(BadInput):
    """A plugin component could not be registered, found or built, or broke its contract."""


class BadInputLines(BadInput):
    """Bad input told in several lines (a headline, then one line per problem): each line is
    escaped on its own when shown, so the message's own line breaks stay line breaks while a
    newline inside a value from a file still cannot start a line."""

    def __init__(self, headline: str, details: list[str]):
        self.lines = [headline, *(f"  {detail}" for detail in details)]
        super().__init__("\n".join(self.lines))
