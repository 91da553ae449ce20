"""Values from files, made safe to print for a person reading a terminal.

A receipt_id, device or path comes from a manifest or an index dir that someone else may
have written. Printed raw, a newline in it starts a line the tool never wrote (a fake
"DUPLICATE of ..." verdict) and an ESC starts a terminal control sequence (clearing the
screen, moving the cursor). ``printable`` shows such characters as escapes instead;
ordinary Unicode (accents, CJK, emoji) is kept. JSON output needs none of this: JSON
escapes control characters itself.
"""

from __future__ import annotations

import re
import unicodedata

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}
# Unicode categories that are not drawn as text: controls, format marks (bidi overrides,
# zero-width), separators other than the space, unassigned and private-use code points
_HIDDEN = {"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"}


def _escape(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(value) -> str:
    """``str(value)`` with control characters, newlines, ESC and other invisible code points
    shown as backslash escapes (``\\n``, ``\\x1b``, ``\\u202e``), so one value prints as one
    visible run of text. A backslash is doubled, so an escape cannot be faked either."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_escape(c) if c in _NAMED or unicodedata.category(c) in _HIDDEN else c for c in text)


def printable_lines(text: str) -> str:
    """A message of several lines the tool wrote (a table, a summary), each line made
    :func:`printable` on its own: the tool's line breaks stay, a path or value in a line cannot
    send a terminal control sequence."""
    return "\n".join(printable(line) for line in text.split("\n"))


SHOWN_CHARACTERS = 200  # of one value in an error message: a value pasted by mistake can be megabytes


def shortened(value, limit: int = SHOWN_CHARACTERS) -> str:
    """``str(value)``, or its first ``limit`` characters and how many there are in all, so an
    error about a huge value is one readable line, not the value again."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def quoted(value) -> str:
    """``'value'`` for a message that :func:`printable` escapes once when it is shown; ``repr``
    would escape it a first time already (and name numpy's ``np.str_('x')`` for a column value)."""
    return f"'{value}'"


def utf8_safe(text: str) -> str:
    """``text`` as it is, or with each code point UTF-8 cannot encode shown as a backslash escape
    (``\\ud800``), so a CSV, a page or a plot can write it. Such a lone surrogate comes from a JSON
    ``"\\ud800"`` in a dataset an older ingest accepted, or from a file name that is not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


# A spreadsheet runs a cell starting with one of these as a formula (=HYPERLINK(...), +cmd|...)
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
# bidirectional overrides and isolates: invisible, they reorder the text drawn around them
_BIDI_CONTROLS = re.compile("[\u202a-\u202e\u2066-\u2069]")


def spreadsheet_safe(value):
    """A text value for a CSV a reviewer opens in a spreadsheet: one that a spreadsheet would run
    as a formula gets a leading ``'`` (numbers such as ``-0.25`` stay numbers), and a bidi
    override is written as its escape (``\\u202e``), so a receipt id cannot run a formula or show
    another id's text. Other values are returned as they are."""
    if not isinstance(value, str):
        return value
    if _BIDI_CONTROLS.search(value):
        value = _BIDI_CONTROLS.sub(lambda match: _escape(match.group()), value)
    if value.startswith(_FORMULA_STARTS) and not _NUMBER.fullmatch(value):
        value = "'" + value
    return value
