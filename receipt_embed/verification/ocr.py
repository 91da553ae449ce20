"""The OCR fields verifier: the printed date, total, receipt number and shop read from the capture itself.

The ``fields`` verifier (receipt_embed.verification.fields) compares fields from manifest columns,
so a query image, which has no row, gives it nothing to compare. This one reads them from the
pixels with an OCR engine (RapidOCR: PP-OCR detection and recognition models run by onnxruntime,
bundled inside the ``rapidocr`` wheel, so nothing is downloaded at run time), normalises them with
the fields verifier's normalisers and scores a pair by the same rule: 0 when a field both captures
carry differs, 1 when all shared ones agree, 0.5 with ``abstain`` when they share none.

Reading is kept apart from parsing: :func:`read_words` runs the engine, :func:`text_rows` joins its
word boxes into printed lines, and :func:`parse_fields` finds the fields in those lines, so the
parsing is tested on tables of OCR-like lines without the engine. OCR errs, and a wrong value is
worse than none (it tells the verifier "another receipt"), so the parsers take a value only where a
label or the layout says what it is (``TOTAL`` but not ``SUBTOTAL``, ``TOTAL QTY``, ``CASH`` or
``CHANGE``; a date whose year is plausible) and leave the field empty otherwise.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from receipt_embed.errors import BadInput
from receipt_embed.verification.fields import MONTHS, FieldsVerifier, normalise_amount, normalise_date

INSTALL_HINT = 'pip install "receipt-embed[ocr]"'
OCR_FIELDS = ("date", "total", "receipt_number", "merchant")  # what parse_fields can find
DEFAULT_OCR_FIELDS = ("date", "total")  # merchant: OCR misreads a shop name too often (benchmarks/README.md)
YEARS = (1990, 2040)  # a printed date outside these years is an OCR misreading (25-12-50) or not a date
MERCHANT_ROWS = 4  # the shop's name is within the first text rows of the page

# the bundled models of rapidocr 3.x (PP-OCRv6 small detection and recognition, the v2 angle
# classifier): named explicitly, so the engine never looks for (or downloads) another one
BUNDLED_MODELS = {
    "Det": "PP-OCRv6_det_small.onnx",
    "Rec": "PP-OCRv6_rec_small.onnx",
    "Cls": "ch_ppocr_mobile_v2.0_cls_mobile.onnx",
}


# --- parsing: OCR lines -> printed fields ------------------------------------------------------

_MONTH_NAMES = "|".join(sorted(MONTHS, key=len, reverse=True))
_NUMERIC_DATE = re.compile(
    r"(?<![\d.,])(\d{4}|\d{1,2})(?:([/\-])\s?(\d{1,2})\s?\2\s?|(\.)(\d{1,2})\4)"
    r"(?:\d{4}(?=\d{1,2}:\d{2})|\d{2}(?=\d{1,2}:\d{2})|(?:\d{4}|\d{2})(?!\d))"
)  # one separator used twice; a space may follow / and - (OCR spaces), never a dot: "4. 1.50" is not a date;
# the last part may run into the time (OCR drops the space: 25/12/201810:31, 2023/01/2617:58:11)
_DAY_MONTH_NAME = re.compile(
    rf"(?<!\d)(\d{{1,2}})(?:st|nd|rd|th)?[\s\-/.]*({_MONTH_NAMES})\b\.?[\s\-/.,]*(\d{{4}}|\d{{2}})(?!\d)", re.I
)
_MONTH_NAME_DAY = re.compile(rf"\b({_MONTH_NAMES})\b\.?\s*(\d{{1,2}})(?:st|nd|rd|th)?,?\s+(\d{{4}})(?!\d)", re.I)
_DATE_LABEL = re.compile(r"\b(DATE|DATED|TARIKH|DT)\b", re.I)

_AMOUNT = re.compile(r"(?<![\d.,])-?(?:\d{1,3}(?:,\d{3})+|\d+)[.,]\d{2}(?![\d])")
_TOTAL = r"T[O0Q]T[A4][L1I|]"  # TOTAL as OCR reads it (TOTAI, T0TAL)
_TOTAL_WORD = re.compile(_TOTAL, re.I)
_NOT_TOTAL = re.compile(
    rf"S[UV]B[\s\-.]*{_TOTAL}|\b(?!GRAND|NETT?\b|NETT?-?T|ROUND)[A-Z]{{2,4}}-?{_TOTAL}|\bS[A-Z]{{1,2}}\s+{_TOTAL}"  # SUBTOTAL, SUB-TOTAL as
    # OCR reads it: SUOTOTAL, DU-TOTAL, SAH TOTAL (a shorter word glued or hyphened to TOTAL)
    rf"|{_TOTAL}\W*(?:OF\W*)?(?:[QO]TY|[QO]UANT|IT[EA]|PCS|UNIT|DISC|SAV|TA[XK]|[G6C]S[T7I1]|SST|EXC|BEFORE"
    r"|WEIGHT|POINT|NO\b|COUNT|LINE|TENDER|\d+%|INC\w*LU?D)"  # TOTAL QTY, TOTAL ITEMS (ITEAS), TOTAL 6ST
    r"|\bS[UA]?P+L\w*"  # TOTAL 0% SUPPLIES (SUPLIES, SPPLIES)
    rf"|\bIN\W*{_TOTAL}|\b(?:GST|SST|TA[XK]|VAT)\b.*{_TOTAL}"  # GST 6% INCLUDED IN TOTAL, TAX TOTAL, GST SUMMARY
    r"|\b(?:CHANGE|CASH|TENDER|TENDERED|PAYMENT|CARD|VISA|MASTER|CREDIT|DEBIT|POINTS?|[QO]TY|QUANTITY|EXC[L1I]\w*)\b",
    re.I,
)
# a total's label, strongest first: the rounded amount is the one paid, then totals that say they
# include everything, then a plain TOTAL
_TOTAL_TIERS = (
    re.compile(rf"R[O0]UND(?:ED|ING|D)?\W*(?:\w\W+)?{_TOTAL}|{_TOTAL}\W*R[O0]UND", re.I),
    re.compile(
        rf"GRAND\W*{_TOTAL}|NET+\W*{_TOTAL}|{_TOTAL}\W*(?:AMOUNT\W*)?(?:DUE|P\w{{1,3}}[BD]\w?LE|INC(?!\w*LU?D)|NET+)"
        rf"|{_TOTAL}\W*(?:SALES?|AMOUNT|AMT)\W*(?:\(?\s*INC)|AMOUNT\W*(?:DUE|PAYABLE)",
        re.I,
    ),
    _TOTAL_WORD,
)

_NUMBER_LABEL = re.compile(
    r"\b(?:RECEIPT|RCPT|RECPT|INVOICE|INV|BILL|DOC|DOCUMENT|TRANS|TRANSACTION|TRN|TXN|SLIP|CHECK|CHK|ORDER|TAX\s*INVOICE)"
    r"\s*(?:NO|NUMBER|NUM|NBR|#)?\b\.?\s*[:#]?\s*([A-Z0-9][A-Z0-9\-/]*\d[A-Z0-9\-/]*)",
    re.I,
)
_SHOP_SUFFIX = re.compile(
    r"\b(?:SDN\.?\s*BHD|BHD|S/B|SDN|ENTERPRISES?|TRADING|RESTAURANT|RESTORAN|STORES?|MART|MARKET|SUPERMARKET"
    r"|HARDWARE|STATIONERY|BAKERY|PHARMACY|CAFE|KEDAI|HOLDINGS|INDUSTRIES|COMPANY|CO\.|LTD|LIMITED|INC|LLC|GMBH|PLC)\b",
    re.I,
)


def find_date(rows: list[str], day_first: bool = True) -> str:
    """The printed date of the receipt (as printed), or ``""``: the first date on a row labelled as
    a date (``DATE:``, ``TARIKH``), else the first date on the page. A candidate must normalise to
    a calendar-like date in YEARS; numeric ones need one separator used twice (``25/12/2018``,
    ``25-12-18``, ``2018.12.25``) so that amounts, phone and item numbers are not read as dates."""
    labelled = [row for row in rows if _DATE_LABEL.search(row)]
    for group in (labelled, rows):
        for row in group:
            for found in _date_candidates(row):
                normal = normalise_date(found, day_first)
                if normal and YEARS[0] <= int(normal[:4]) <= YEARS[1]:
                    return found
    return ""


def _date_candidates(row: str) -> list[str]:
    spans = []
    for pattern in (_NUMERIC_DATE, _DAY_MONTH_NAME, _MONTH_NAME_DAY):
        spans += [(m.start(), m.group(0)) for m in pattern.finditer(row)]
    return [text for _, text in sorted(spans)]


def find_total(rows: list[str]) -> str:
    """The amount paid (as printed), or ``""``: the amount on the row whose label is the strongest
    total (``ROUNDED TOTAL``; then ``GRAND TOTAL``, ``NETT TOTAL``, ``TOTAL INCL. GST``, ``TOTAL
    AMOUNT DUE``; then ``TOTAL``), the first such row on the page. Rows that name another sum
    (``SUBTOTAL``, ``TOTAL QTY``, ``TOTAL DISCOUNT``, ``TOTAL EXCL. GST``, ``CASH``, ``CHANGE``)
    never count. The amount is the first one after the label with two decimals (a tilted capture
    can join the next line's amount to the row: ``TOTAL 28.00 CASH 40.00``); when the row has none, the next row's when that row holds an amount alone (OCR split label and amount)."""
    candidates = [(i, row) for i, row in enumerate(rows) if _TOTAL_WORD.search(row) and not _NOT_TOTAL.search(row)]
    for tier in _TOTAL_TIERS:
        for i, row in candidates:
            label = tier.search(row)
            if not label:
                continue
            after = row[label.end() :]
            if tier is _TOTAL_WORD and (
                len(_words_before_amount(after)) > 1
                or len(_AMOUNT.findall(after)) > 1
                or re.search(r"\d", _AMOUNT.split(after, maxsplit=1)[0])
            ):
                continue  # a plain TOTAL names its sum in a word at most (TOTAL AMOUNT) and has one amount
                # and no other number: else it is another sum (TOTAL 0% SUPPLIES), a table's (GST
                # SUMMARY ... TOTAL 255.00 15.30) or a misread one (TOTAL: 200 0.12)
            amount = _first_amount(after)
            if not amount and i + 1 < len(rows) and _only_amount(rows[i + 1]):
                amount = _first_amount(rows[i + 1])
            if amount:
                return amount
    return ""


_CURRENCY = r"\b(?:RM|MYR|R|S|USD|SGD|EUR|GBP)"  # written before an amount, often without a space (RM9.00)


def _words_before_amount(text: str) -> list[str]:
    head = _AMOUNT.split(text, maxsplit=1)[0]
    return [w for w in re.findall(r"[A-Za-z]{2,}", head) if not re.fullmatch(_CURRENCY, w, re.I)]


def _first_amount(text: str) -> str:
    """The first positive two-decimal amount standing on its own or after a currency (``RM9.00``),
    not glued to a word (``Sc1.46`` is OCR's reading of a word, not an amount)."""
    for found in _AMOUNT.finditer(text):
        before = text[: found.start()]
        glued = re.search(r"[A-Za-z]$", before) and not re.search(_CURRENCY + "$", before, re.I)
        if not glued and not found.group(0).startswith("-") and normalise_amount(found.group(0)) not in ("", "0"):
            return found.group(0)
    return ""


def _only_amount(row: str) -> bool:
    return bool(re.fullmatch(rf"\W*(?:{_CURRENCY})?\W*" + _AMOUNT.pattern + r"\W*", row.strip(), re.I))


def find_receipt_number(rows: list[str]) -> str:
    """The receipt or invoice number (as printed), or ``""``: the value after a label such as
    ``Receipt No:``, ``Invoice #``, ``Bill No.``, ``Doc No``, ``Trans No``; it must hold a digit."""
    for row in rows:
        found = _NUMBER_LABEL.search(row)
        if found:
            return found.group(1)
    return ""


_REGISTRATION = re.compile(r"\([^()]*\d[^()]*\)?|\b(?:CO\.?\s*REG|ROC|GST\s*(?:REG|ID)|SST\s*ID)\b.*$", re.I)
_SUFFIX_AS_READ = ((re.compile(r"\bS[O0D]N\b\.?\s*B[HN][DO0]\b\.?", re.I), "SDN BHD"),)
_DIGIT_AS_LETTER = str.maketrans("0158", "OISB")


def clean_merchant(text: str) -> str:
    """A shop name as OCR printed it, without what tells a receipt's company apart only on paper:
    a registration number in brackets (``URBAN IDEA SDN BHD (417940-M)``) or after ``CO. REG``;
    with ``SDN BHD`` as OCR misreads it (``SON BHO``) and digits inside a word of letters
    (``1DEA``) read as the letters they resemble."""
    text = _REGISTRATION.sub(" ", text)
    for pattern, fixed in _SUFFIX_AS_READ:
        text = pattern.sub(fixed, text)
    words = [
        word.translate(_DIGIT_AS_LETTER) if re.search(r"[A-Za-z]{2}", word) and _mostly_letters(word) else word
        for word in text.split()
    ]
    return " ".join(words).strip(" -:,.")


def _mostly_letters(word: str) -> bool:
    letters, digits = sum(ch.isalpha() for ch in word), sum(ch.isdigit() for ch in word)
    return 0 < digits < letters


def _could_be_a_name(row: str) -> bool:
    """At least three letters, more letters than digits (not ``TEL: 03-7845 1234``), no amount."""
    letters, digits = sum(ch.isalpha() for ch in row), sum(ch.isdigit() for ch in row)
    return letters >= 3 and letters > digits and not _AMOUNT.search(row)


def find_merchant(rows: list[str]) -> str:
    """The shop's name (as printed), or ``""``: among the first MERCHANT_ROWS rows that could be a
    name (the top of the page, where receipts print the shop), the first one that names a
    company (``SDN BHD``, ``ENTERPRISE``, ``TRADING``, ``RESTAURANT`` ...), joined to the row above
    when it is that suffix alone; else the first of them."""
    top = [row.strip() for row in rows if _could_be_a_name(row)][:MERCHANT_ROWS]
    for i, row in enumerate(top):
        suffix = _SHOP_SUFFIX.search(row)
        if suffix:
            alone = not re.search(r"[A-Za-z]", row[: suffix.start()] + row[suffix.end() :])
            return clean_merchant(f"{top[i - 1]} {row}" if alone and i > 0 else row)
    return clean_merchant(top[0]) if top else ""


def parse_fields(rows: list[str], day_first: bool = True) -> dict[str, str]:
    """Every field of OCR_FIELDS found in printed text ``rows`` (top to bottom, each a line read
    left to right), as printed; a field not found is ``""``."""
    return {
        "date": find_date(rows, day_first),
        "total": find_total(rows),
        "receipt_number": find_receipt_number(rows),
        "merchant": find_merchant(rows),
    }


@dataclass(frozen=True)
class Word:
    """One text box the OCR engine read: its ``text``, recognition ``score`` and its box
    (``left``, ``top``, ``right``, ``bottom``) in pixels of the image it read."""

    text: str
    score: float
    left: float
    top: float
    right: float
    bottom: float


def text_rows(words: list[Word]) -> list[str]:
    """Printed lines from word boxes (a receipt prints a label on the left and its amount on the
    right: two boxes of one line). Taken left to right, a box joins the line whose last box it
    overlaps most vertically, by at least half the lower box's height; comparing neighbours, not a
    whole line, keeps the lines of a tilted capture apart. Lines top to bottom, joined by a space."""
    lines: list[list[Word]] = []
    for word in sorted(words, key=lambda w: (w.left, w.top)):
        best, best_overlap = None, 0.0
        for line in lines:
            last = line[-1]
            if last.right > word.right:
                continue  # a line already reaching past this box is another one (or a wide box above)
            overlap = min(last.bottom, word.bottom) - max(last.top, word.top)
            if overlap >= 0.5 * min(last.bottom - last.top, word.bottom - word.top) and overlap > best_overlap:
                best, best_overlap = line, overlap
        if best is None:
            lines.append([word])
        else:
            best.append(word)
    lines.sort(key=lambda line: (sum((w.top + w.bottom) / 2 for w in line) / len(line), line[0].left))
    return [" ".join(w.text for w in line) for line in lines]


# --- reading: pixels -> words ------------------------------------------------------------------

_ENGINES: dict[tuple, object] = {}
_ENGINES_LOCK = threading.Lock()


def require_engine() -> None:
    """Import rapidocr and onnxruntime, or say how to install them. onnxruntime 1.32 on Linux
    queues usage events for upload (under ``~/.cache/Microsoft/DeveloperTools``) unless
    ``ORT_DISABLE_TELEMETRY`` is set when it is first imported: it is set here (unless already
    set), so reading receipts sends nothing anywhere."""
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    try:
        import onnxruntime  # noqa: F401
        import rapidocr  # noqa: F401
    except ImportError as exc:
        raise BadInput(
            f"verifier ocr_fields: the OCR engine is not installed ({exc}); install it with: {INSTALL_HINT}"
        ) from None


def engine(long_side: int = 1024, threads: int = 1, min_score: float = 0.5):
    """A RapidOCR engine on the bundled models, one per process and setting (building one loads
    three ONNX models). ``long_side``: the detector runs at most at this size (RapidOCR's default
    enlarges every page until its short side is 736 pixels: a receipt's long side then reaches
    1,500 and more, at twice the cost); ``threads``: onnxruntime's intra-op threads;
    ``min_score``: recognitions scored below it are dropped."""
    key = (long_side, threads, min_score)
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            require_engine()
            import rapidocr
            from rapidocr import RapidOCR

            models = Path(rapidocr.__file__).resolve().parent / "models"
            missing = [name for name in BUNDLED_MODELS.values() if not (models / name).is_file()]
            if missing:
                raise BadInput(
                    f"verifier ocr_fields: rapidocr {getattr(rapidocr, '__version__', '?')} lacks the bundled "
                    f"models {', '.join(missing)} in {models}; install the supported version with: {INSTALL_HINT}"
                )
            params = {
                "Global.log_level": "error",
                "Global.text_score": float(min_score),
                "Global.max_side_len": 4096,
                "Det.limit_type": "max",
                "Det.limit_side_len": int(long_side),
                "EngineConfig.onnxruntime.intra_op_num_threads": int(threads),
                "EngineConfig.onnxruntime.inter_op_num_threads": 1,
                **{f"{task}.model_path": str(models / name) for task, name in BUNDLED_MODELS.items()},
            }
            _ENGINES[key] = RapidOCR(params=params)
        return _ENGINES[key]


def read_words(image: np.ndarray, long_side: int = 1024, threads: int = 1, min_score: float = 0.5) -> list[Word]:
    """The text boxes of a capture (uint8 H x W x 3 RGB or H x W grayscale), read with the capture
    resized so that its long side is ``long_side`` pixels (enlarged too: receipt text in a small
    capture is a few pixels high, and the recogniser reads a line at 48 pixels)."""
    import cv2

    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim not in (2, 3):
        raise BadInput("verifier ocr_fields: a capture must be a uint8 H x W or H x W x 3 array")
    if image.ndim == 3:
        image = image[:, :, 0] if image.shape[2] == 1 else image[:, :, :3]
    height, width = image.shape[:2]
    if min(height, width) < 8:
        return []
    scale = long_side / max(height, width)
    if scale != 1.0:
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        image = cv2.resize(image, size, interpolation=cv2.INTER_CUBIC if scale > 1 else cv2.INTER_AREA)
    if image.ndim == 2:
        bgr = cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
    else:
        bgr = cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2BGR)  # the engine reads BGR
    result = engine(long_side, threads, min_score)(bgr)
    boxes, texts, scores = (
        getattr(result, "boxes", None),
        getattr(result, "txts", None),
        getattr(result, "scores", None),
    )
    if boxes is None or texts is None:
        return []
    words = []
    for box, text, score in zip(boxes, texts, scores):
        box = np.asarray(box, dtype=float).reshape(-1, 2)
        if text.strip():
            words.append(Word(text.strip(), float(score), *box.min(axis=0), *box.max(axis=0)))
    return words


# --- the verifier ------------------------------------------------------------------------------


@dataclass
class OcrFieldsVerifier(FieldsVerifier):
    """Compares printed fields read from the capture by OCR (the manifest row is not read).

    fields: which of date, total, receipt_number, merchant are compared (default date and total:
        on small captures OCR misreads a shop name more often than it reads it right, and one
        misread field makes two captures of a receipt "differ"; see benchmarks/README.md).
    day_first: how numeric dates whose year is last are read (25/12/2018, or 12/25/2018).
    veto: off by default: OCR misreads a field of a true re-capture often enough (measured in
        benchmarks/README.md) that a differing read is evidence, not proof.
    long_side: the capture's long side is resized to this many pixels before OCR (default 1024;
        smaller captures are enlarged). The cost grows with it, about as its square.
    min_score: recognitions the engine scores below this are dropped (0.5, RapidOCR's default).
    threads: onnxruntime's intra-op threads (1: reproducible, and leaves the other cores free).
    """

    fields: list[str] = field(default_factory=lambda: list(DEFAULT_OCR_FIELDS))
    veto: bool = False
    long_side: int = 1024
    min_score: float = 0.5
    threads: int = 1
    needs_image = True  # extract() reads the capture's pixels
    name = "ocr_fields"

    def __post_init__(self):
        super().__post_init__()
        unknown = [f for f in self.fields if f not in OCR_FIELDS]
        if unknown:
            raise BadInput(
                f"verifier ocr_fields: fields must be among {', '.join(OCR_FIELDS)}, got {', '.join(map(repr, unknown))}"
            )
        if not (
            isinstance(self.long_side, int) and not isinstance(self.long_side, bool) and 256 <= self.long_side <= 4096
        ):
            raise BadInput(f"verifier ocr_fields: long_side must be an int in [256, 4096], got {self.long_side!r}")
        if not (isinstance(self.min_score, (int, float)) and 0.0 <= self.min_score < 1.0):
            raise BadInput(f"verifier ocr_fields: min_score must be in [0, 1), got {self.min_score!r}")
        if not (isinstance(self.threads, int) and not isinstance(self.threads, bool) and 1 <= self.threads <= 256):
            raise BadInput(f"verifier ocr_fields: threads must be an int in [1, 256], got {self.threads!r}")
        require_engine()  # fail now, with the install hint, not on the first capture

    def read(self, image: np.ndarray) -> dict[str, str]:
        """The printed fields OCR finds in one capture, as printed (``""`` where none is found)."""
        rows = text_rows(read_words(image, self.long_side, self.threads, float(self.min_score)))
        return parse_fields(rows, self.day_first)

    def extract(self, image: np.ndarray, item: dict | None = None) -> dict[str, np.ndarray]:
        """``values``: one normalised string per field of ``fields``, read from the capture's pixels."""
        printed = self.read(image)
        return {"values": np.array([self.normalise(column, printed[column]) for column in self.fields], dtype=str)}
