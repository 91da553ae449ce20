"""The fields verifier: do two captures carry the same printed date, total, receipt number and shop?

Same-shop siblings share a printed template, so the image alone struggles to tell them apart
(receipt_embed.verification.geometric); the fields printed on them do: date + total is unique for
every distinct receipt of the shared SROIE set, and expense tools key their duplicate checks on
exactly those. The values come from manifest columns (most teams already have OCR output, and
``ingest`` keeps extra columns), normalised so that one value written two ways compares equal:
``25/12/2018`` = ``25-12-18`` = ``2018-12-25``, ``RM 9.00`` = ``9`` = ``9,00``, ``No. 000123`` =
``123``, ``Book Ta.K`` = ``BOOK TA K``.

Score: 0 when a field both captures carry differs (another receipt), 1 when every field both
carry agrees, 0.5 with ``abstain`` when they share none (no evidence either way: the verified
score, the mean of the verifiers' scores, leaves it out). A differing field also *vetoes* the pair
(``veto``, on by default): its verified score is 0 however alike the images look, since a mean would
let a same-template sibling with a high geometric score pass a low threshold. Measured on two seeds
(benchmarks/README.md), the veto keeps every verified pair above 0.2 the same receipt where the mean
let 13% through, at no cost in recall; turn it off (``--verify-set fields.veto=false``) when the
manifest's fields are misread often enough that a differing field is no proof.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

import numpy as np

from receipt_embed.errors import BadInput

MONTHS = {
    name: number
    for number, names in enumerate(
        (
            ("jan", "january"),
            ("feb", "february"),
            ("mar", "march"),
            ("apr", "april"),
            ("may",),
            ("jun", "june"),
            ("jul", "july"),
            ("aug", "august"),
            ("sep", "sept", "september"),
            ("oct", "october"),
            ("nov", "november"),
            ("dec", "december"),
        ),
        start=1,
    )
    for name in names
}
# which normaliser a column gets, by its name; any other column compares as text
KINDS = {"date": "date", "total": "amount", "amount": "amount", "receipt_number": "number", "merchant": "text"}
DEFAULT_FIELDS = ("date", "total", "receipt_number", "merchant")


def normalise_date(value: str, day_first: bool = True) -> str:
    """A printed date as ``YYYY-MM-DD`` (``""`` when it is not one). Numeric dates are day first
    unless ``day_first`` is False (then month first) when the year is not first; two-digit years
    are 20YY below 70, else 19YY; a month may be a name (``25 Dec 2018``, ``Dec 25, 2018``); eight
    digits without separators read year first when they start 19 or 20 and hold a month there
    (``20180428``), else as day, month, year (``25032018``). A numeric date that cannot be read in
    the assumed order (``12/25/2018`` day first) is read in the other."""
    text = str(value).strip().lower()
    swappable = False  # numeric day and month whose order is only assumed
    found = re.search(r"(\d{1,4})\s*[/\-.\s]\s*([a-z]{3,9}|\d{1,2})\.?\s*[/\-.\s,]\s*(\d{2,4})", text)
    named_first = re.search(r"([a-z]{3,9})\.?\s+(\d{1,2})(?:st|nd|rd|th)?,?\s+(\d{2,4})", text)
    compact = re.fullmatch(r"\D*(\d{8})\D*", text)  # 20180428 or 25032018, printed without separators
    if compact and not found:
        digits = compact.group(1)
        if digits[:2] in ("19", "20") and 1 <= int(digits[4:6]) <= 12:
            found_parts = (digits[6:], digits[4:6], digits[:4])
        else:
            found_parts = (digits[:2], digits[2:4], digits[4:]) if day_first else (digits[2:4], digits[:2], digits[4:])
        day, month, year = found_parts
    elif found:
        first, middle, last = found.groups()
        if middle.isalpha():
            if middle not in MONTHS:
                return ""
            day, month, year = first, MONTHS[middle], last
        elif len(first) == 4:
            year, month, day = first, middle, last
        elif day_first:
            day, month, year = first, middle, last
            swappable = True
        else:
            month, day, year = first, middle, last
            swappable = True
    elif named_first and named_first.group(1) in MONTHS:
        month, day, year = MONTHS[named_first.group(1)], named_first.group(2), named_first.group(3)
    else:
        return ""
    try:
        day, month, year = int(day), int(month), int(year)
    except ValueError:
        return ""
    if swappable and month > 12 and 1 <= day <= 12:  # 12/25/2018 read day first cannot be: month first it is
        day, month = month, day
    if year < 100:
        year += 2000 if year < 70 else 1900
    if not (1 <= month <= 12 and 1 <= day <= 31 and 1900 <= year <= 2199):
        return ""
    return f"{year:04d}-{month:02d}-{day:02d}"


def normalise_amount(value: str) -> str:
    """A printed amount as a plain decimal without trailing zeros (``RM 1,234.50`` -> ``1234.5``;
    ``9.00`` -> ``9``; ``1.234,50`` -> ``1234.5``); ``""`` when it holds no number. The last of
    ``.`` and ``,`` is the decimal mark when both appear; a lone ``,`` followed by exactly two
    digits is one too (``9,00``), else it separates thousands."""
    text = re.sub(r"[^0-9.,\-]", "", str(value))
    text = text.strip(".,")
    if not re.search(r"\d", text):
        return ""
    if "," in text and "." in text:
        decimal = "," if text.rfind(",") > text.rfind(".") else "."
        thousands = "." if decimal == "," else ","
        text = text.replace(thousands, "").replace(decimal, ".")
    elif "," in text:
        text = text.replace(",", ".") if re.search(r",\d{2}$", text) and text.count(",") == 1 else text.replace(",", "")
    if text.count(".") > 1:  # 1.234.567: thousands marks
        text = text.replace(".", "")
    try:
        number = Decimal(text)
    except InvalidOperation:
        return ""
    normal = format(number.normalize(), "f")
    return "0" if normal in ("-0", "") else normal


def normalise_number(value: str) -> str:
    """A receipt or invoice number: letters and digits only, upper case, leading zeros of its
    digits dropped (``No. 000123`` -> ``123``, ``inv-0042a`` -> ``INV42A``)."""
    text = re.sub(r"^(no|nr|num|number|#)\b\.?", "", str(value).strip(), flags=re.IGNORECASE)
    text = "".join(ch for ch in unicodedata.normalize("NFKC", text).upper() if ch.isalnum())
    return re.sub(r"(?<![0-9])0+(?=[0-9])", "", text)


def normalise_text(value: str) -> str:
    """A shop name or other text: NFKC, upper case, punctuation to spaces, spaces collapsed."""
    text = unicodedata.normalize("NFKC", str(value)).upper()
    return " ".join("".join(ch if ch.isalnum() else " " for ch in text).split())


NORMALISERS = {"date": normalise_date, "amount": normalise_amount, "number": normalise_number, "text": normalise_text}


@dataclass
class FieldsVerifier:
    """Compares printed fields taken from manifest columns. fields: the columns compared (a column
    named date, total/amount, receipt_number or merchant gets that kind's normaliser, any other is
    text; a capture without the column, or with a value that does not parse, does not count).
    day_first: how numeric dates whose year is last are read (25/12/2018, or 12/25/2018).
    veto: a differing field makes the pair's verified score 0, whatever the other verifiers say."""

    fields: list[str] = field(default_factory=lambda: list(DEFAULT_FIELDS))
    day_first: bool = True
    veto: bool = True
    needs_image = False  # extract() reads the manifest row only
    name = "fields"  # the registered name, for messages (a subclass that reads fields elsewhere renames it)

    def __post_init__(self):
        if isinstance(self.fields, str) or not self.fields or not all(isinstance(f, str) and f for f in self.fields):
            raise BadInput(
                f"verifier {self.name}: fields must be a non-empty list of column names, got {self.fields!r}"
            )
        if not isinstance(self.day_first, bool):
            raise BadInput(f"verifier {self.name}: day_first must be true or false, got {self.day_first!r}")
        if not isinstance(self.veto, bool):
            raise BadInput(f"verifier {self.name}: veto must be true or false, got {self.veto!r}")
        self.fields = list(dict.fromkeys(self.fields))

    def normalise(self, column: str, value) -> str:
        if value is None:
            return ""
        kind = KINDS.get(column, "text")
        if kind == "date":
            return normalise_date(value, self.day_first)
        return NORMALISERS[kind](value)

    def check_rows(self, rows: list[dict]) -> list[str]:
        """What ``index --verify fields`` says before extracting: a field no capture carries (with
        a value that reads as its kind) is never compared; when none is carried, the verifier
        could only abstain, so that is refused naming the columns the captures do have."""
        usable = {column: sum(1 for row in rows if self.normalise(column, row.get(column))) for column in self.fields}
        if rows and not any(usable.values()):
            present = sorted({key for row in rows for key in row})
            raise BadInput(
                f"verifier fields: no capture has a usable value in {', '.join(self.fields)}, so it could only "
                f"abstain; the captures' columns are {', '.join(present)}: pick some with "
                "--verify-set fields.fields=[COLUMN,...]"
            )
        notes = []
        for column, count in usable.items():
            if count == 0:
                notes.append(f"verifier fields: no capture has a {column} value, so {column} is never compared")
            elif count < len(rows):
                notes.append(
                    f"verifier fields: {len(rows) - count} of {len(rows)} captures have no {column} value that reads "
                    f"as {'an' if KINDS.get(column, 'text')[0] in 'aeiou' else 'a'} {KINDS.get(column, 'text')}; those pairs are "
                    "judged on their other fields"
                )
        return notes

    def extract(self, image, item: dict | None = None) -> dict[str, np.ndarray]:
        """``values``: one normalised string per field of ``fields`` (``""`` where the row has none)."""
        item = item or {}
        return {"values": np.array([self.normalise(column, item.get(column)) for column in self.fields], dtype=str)}

    def check_data(self, data) -> None:
        """The stored data holds ``values``, one per field of ``fields`` for every capture: data
        extracted with other ``fields`` would compare one column's value with another's."""
        from receipt_embed.verification.stored import check_keys, per_item_counts

        check_keys(data, ("values",))
        counts = per_item_counts(data, "values")
        if data.arrays["values"].dtype.kind != "U" or np.any(counts != len(self.fields)):
            wrong = (
                int(counts[np.flatnonzero(counts != len(self.fields))[0]])
                if np.any(counts != len(self.fields))
                else None
            )
            held = f"{wrong} values for some capture" if wrong is not None else f"{data.arrays['values'].dtype} values"
            raise BadInput(
                f"it holds {held}, but its params compare {len(self.fields)} text fields ({', '.join(self.fields)}): "
                "the data was extracted with other params"
            )

    def score(self, query: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> dict:
        """``score`` (0: a shared field differs; 1: all shared fields agree; 0.5: none shared), with
        the fields that ``agree`` and ``differ``, and ``veto`` when one differs and ``veto`` is on."""
        agree, differ, read_as = [], [], []
        for column, a, b in zip(self.fields, query["values"].tolist(), candidate["values"].tolist(), strict=False):
            if a and b:
                (agree if a == b else differ).append(column)
                if a != b:  # as normalised, so a reviewer sees why (a date read day first, say)
                    read_as.append(f"{column} {a} / {b}")
        score = 0.0 if differ else 1.0 if agree else 0.5
        # no field in common: no evidence, so the verified score leaves this verifier out
        result = {
            "score": score,
            "agree": agree,
            "differ": differ,
            "abstain": not (agree or differ),
            "veto": bool(differ) and self.veto,
        }
        return {**result, "read_as": read_as} if read_as else result
