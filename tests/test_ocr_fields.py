"""The OCR fields verifier: fields are found in OCR-like lines of real receipts (and distractors such
as SUBTOTAL, CASH and CHANGE are not taken for them), the engine reads a rendered receipt's date and
total, the verifier keeps the contract, and a missing engine is one line naming the pip extra."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from receipt_embed.errors import BadInput
from receipt_embed.verification.fields import FieldsVerifier
from receipt_embed.verification.ocr import (
    INSTALL_HINT,
    OcrFieldsVerifier,
    Word,
    clean_merchant,
    engine,
    parse_fields,
    text_rows,
)

NORMAL = FieldsVerifier()

# (OCR lines top to bottom, expected fields after normalisation; "" = not found)
RECEIPTS = [
    pytest.param(
        [
            "tan woon yann",
            "BOOK TA .K (TAMAN DAYA) SDN BHD",
            "NO.5: 55,57 & 59, JALAN SAGU 18,",
            "Document No : TD01167104",
            "Date : 25/12/2018 8:13:39 PM",
            "Cashier : MANIS",
            "CASH BILL",
            "Total : 9.00",
            "Rounding Adjustment 0.00",
            "Rounded Total (RM): 9.00",
            "Cash 10.00",
            "CHANGE 1.00",
        ],
        {"date": "2018-12-25", "total": "9", "receipt_number": "TD1167104", "merchant": "BOOK TA K TAMAN DAYA SDN BHD"},
        id="sroie-book-tak",
    ),
    pytest.param(
        [
            "MR. D.I.Y. (M) SDN BHD",
            "(CO.REG :860671-D)",
            "LOT 1851-A & 1851-B, JALAN KPB 6,",
            "(GST ID No :000306020352)",
            "Item(s) : 3 Qty(s) : 3",
            "Total Incl. GST@6% RM 28.00",
            "CASH RM 40.00",
            "CHANGE RM 12.00",
            "GST @6% included in total RM 1.58",
            "26-03-18 15:25 SH01 ZJ86 T1 R000112587",
        ],
        {"date": "2018-03-26", "total": "28", "receipt_number": "", "merchant": "MR D I Y M SDN BHD"},
        id="sroie-mr-diy-two-digit-year",
    ),
    pytest.param(
        [
            "SYARIKAT PERNIAGAAN GIN KEE",
            "(81109-A)",
            "Doc No : CS00011956 Date : 12/02/2018",
            "Total Qty 3",
            "Total Sales (Excluding GST) 255.00",
            "Total GST 15.30",
            "Total Sales (Inclusive of GST) 270.30",
            "CASH 300.00",
            "Change 29.70",
            "GST SUMMARY Amount(RM) Tax(RM)",
            "SR @ 6% 255.00 15.30",
            "Total: 255.00 15.30",
        ],
        {
            "date": "2018-02-12",
            "total": "270.3",
            "receipt_number": "CS11956",
            "merchant": "SYARIKAT PERNIAGAAN GIN KEE",
        },
        id="sroie-excl-and-gst-summary-distractors",
    ),
    pytest.param(
        [
            "GARDENIA BAKERIES (KL) SDN BHD (139386 X)",
            "Invoice No.: 7017F713",
            "Date: 05/10/2017",
            "Total 0% supplies: 23.44",
            "Total 6% supplies (Excl. GST): 26.40",
            "Total 6% supplies (Inc. GST): 27.98",
            "Total Payable: 51.42",
        ],
        {
            "date": "2017-10-05",
            "total": "51.42",
            "receipt_number": "7017F713",
            "merchant": "GARDENIA BAKERIES KL SDN BHD",
        },
        id="sroie-supplies-then-payable",
    ),
    pytest.param(
        ["UNIHAKKA INTERNATIONAL SDN BHD", "30 MAR 2018 18:20", "SUBTOTAL 8.20", "GRAND TOTAL $8.20", "CASH $10.00"],
        {"date": "2018-03-30", "total": "8.2", "receipt_number": "", "merchant": "UNIHAKKA INTERNATIONAL SDN BHD"},
        id="named-month-and-grand-total",
    ),
    pytest.param(
        ["KEDAI RUNCIT AH SENG", "2018-12-25 10:31", "SUB-TOTAL 12.50", "TOTAL (RM) : 13.25", "TOTAL QTY : 4"],
        {"date": "2018-12-25", "total": "13.25", "receipt_number": "", "merchant": "KEDAI RUNCIT AH SENG"},
        id="year-first-and-total-rm-colon",
    ),
    pytest.param(
        ["99 SPEED MART S/B (519537-X)", "INVOICE NO 17901/102/T0298", "Dec 14, 2016", "TOTAL", "RM 61.65"],
        {"date": "2016-12-14", "total": "61.65", "receipt_number": "17901102T298", "merchant": "99 SPEED MART S B"},
        id="label-and-amount-on-two-lines",
    ),
    pytest.param(
        ["URBAN 1DEA SON BHO (417940-M)", "Served by: rojan 27/02/2018 15:32:47", "Rounded Totai (RM): 24.00"],
        {"date": "2018-02-27", "total": "24", "receipt_number": "", "merchant": "URBAN IDEA SDN BHD"},
        id="ocr-misreadings-of-labels-and-names",
    ),
    pytest.param(
        ["TEL: 03-7845 1234", "GST ID: 000306020352", "4. 1.50 3.00", "Total Sc1.46", "CASH 20.00", "CHANGE 5.00"],
        {"date": "", "total": "", "receipt_number": "", "merchant": ""},
        id="phone-numbers-prices-and-glued-words-are-no-fields",
    ),
    pytest.param(
        ["THE CORNER CAFE", "Printed 01/01/2019", "DATE: 25/12/2018", "TOTAL 9.00 CASH 10.00"],
        {"date": "2018-12-25", "total": "", "receipt_number": "", "merchant": "THE CORNER CAFE"},
        id="labelled-date-first-and-a-total-row-naming-cash-is-refused",
    ),
    pytest.param(
        ["NORTHSIDE FUEL", "2023/01/2617:58:11", "SUBTOTAL 323.31", "TAX 5% 16.17", "TOTAL EUR339.48"],
        {"date": "2023-01-26", "total": "339.48", "receipt_number": "", "merchant": "NORTHSIDE FUEL"},
        id="time-glued-to-the-date-and-currency-to-the-amount",
    ),
    pytest.param(
        ["RESTORAN HASSANBISTRO", "DATE 25-12-50", "SUBTOTAL 8.50", "CASH 9.00", "CHANGE 0.50"],
        {"date": "", "total": "", "receipt_number": "", "merchant": "RESTORAN HASSANBISTRO"},
        id="implausible-year-and-only-distractor-sums",
    ),
]


@pytest.mark.parametrize(("rows", "expected"), RECEIPTS)
def test_fields_are_parsed_from_ocr_lines_of_real_receipt_formats(rows, expected):
    printed = parse_fields(rows)
    assert {name: NORMAL.normalise(name, value) for name, value in printed.items()} == expected


def test_month_first_dates_when_asked():
    month_first = FieldsVerifier(day_first=False)
    assert month_first.normalise("date", parse_fields(["12/25/2018"], day_first=False)["date"]) == "2018-12-25"
    # day first, month 25 does not exist: read month first then
    assert NORMAL.normalise("date", parse_fields(["12/25/2018"])["date"]) == "2018-12-25"


def test_a_shop_name_loses_its_registration_number_and_ocr_confusions():
    assert clean_merchant("URBAN 1DEA SON BHO (417940-M).") == "URBAN IDEA SDN BHD"
    assert clean_merchant("MR. D.I.Y. (M) SDN BHD (CO.REG 860671-D)") == "MR. D.I.Y. (M) SDN BHD"
    assert clean_merchant("TOTAL EUR40.38") == "TOTAL EUR40.38"  # mostly digits: left as read


def _word(text, left, top, right, bottom):
    return Word(text, 0.99, left, top, right, bottom)


def test_word_boxes_join_into_printed_lines_even_on_a_tilted_capture():
    # a capture tilted down to the right: each line's amount box sits 5 pixels lower than its
    # label, closer to the next line's label than a level page would put it
    words = [
        _word("CASH", 10, 52, 60, 64),
        _word("RM 40.00", 200, 57, 270, 69),
        _word("Total Incl. GST", 10, 34, 120, 46),
        _word("RM 28.00", 200, 39, 270, 51),
        _word("MR. D.I.Y. (M) SDN BHD", 30, 5, 220, 20),
    ]
    assert text_rows(words) == ["MR. D.I.Y. (M) SDN BHD", "Total Incl. GST RM 28.00", "CASH RM 40.00"]
    assert text_rows([]) == []


def _verifier(**params):
    from receipt_embed.plugin_manager import get_registry

    return get_registry().create("verifier", "ocr_fields", **params)


def test_the_built_verifier_keeps_the_contract():
    from receipt_embed.testing import check_verifier

    verifier = _verifier()
    assert verifier.needs_image is True and verifier.fields == ["date", "total"]
    check_verifier(verifier)


def test_ocr_reads_the_date_and_total_of_a_rendered_receipt():
    from receipt_embed.samples.receipts import format_money, make_receipt
    from receipt_embed.samples.render import render_receipt

    receipt = make_receipt(0, 5)  # GREENLEAF MARKET, a year-first date
    image = np.asarray(render_receipt(receipt))
    verifier = OcrFieldsVerifier(fields=["date", "total", "merchant"])
    values = verifier.extract(image, {})["values"].tolist()
    assert values == [receipt.issued.strftime("%Y-%m-%d"), NORMAL.normalise("total", format_money(receipt.total_cents)),
                      "GREENLEAF MARKET"]  # fmt: skip
    assert engine(verifier.long_side, 1, 0.5) is engine(verifier.long_side, 1, 0.5)  # built once per process


def test_a_blank_or_tiny_capture_reads_no_field_and_abstains():
    verifier = OcrFieldsVerifier()
    blank = verifier.extract(np.full((400, 200, 3), 255, np.uint8))
    tiny = verifier.extract(np.zeros((3, 2), np.uint8))
    assert blank["values"].tolist() == ["", ""] and tiny["values"].tolist() == ["", ""]
    assert verifier.score(blank, tiny) == {"score": 0.5, "agree": [], "differ": [], "abstain": True, "veto": False}
    # OCR misreads a field of a true re-capture often enough that a differing read is no proof
    assert OcrFieldsVerifier().veto is False


def test_reading_a_receipt_leaves_no_usage_events_for_upload(tmp_path):
    """onnxruntime queues telemetry under ~/.cache/Microsoft unless told not to before its import."""
    import os
    import subprocess

    script = (
        "import numpy as np\n"
        "from receipt_embed.verification.ocr import OcrFieldsVerifier\n"
        "print(OcrFieldsVerifier().extract(np.full((200, 100, 3), 255, np.uint8))['values'].tolist())\n"
    )
    env = {**os.environ, "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("ORT_DISABLE_TELEMETRY", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['', '']"
    assert not (tmp_path / ".cache" / "Microsoft").exists()


@pytest.mark.parametrize("missing", ["rapidocr", "onnxruntime"])
def test_without_the_engine_construction_names_the_pip_extra(monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # the import fails as if it were not installed
    assert INSTALL_HINT == 'pip install "receipt-embed[ocr]"'
    with pytest.raises(BadInput, match=r'pip install "receipt-embed\[ocr\]"'):
        OcrFieldsVerifier()
    with pytest.raises(BadInput, match=r'pip install "receipt-embed\[ocr\]"'):
        _verifier()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"fields": ["date", "shop"]}, "fields must be among date, total, receipt_number, merchant, got 'shop'"),
        ({"fields": []}, "fields must be a non-empty list of column names"),
        ({"long_side": 100}, "long_side must be an int in \\[256, 4096\\], got 100"),
        ({"min_score": 1.5}, "min_score must be in \\[0, 1\\), got 1.5"),
        ({"threads": 0}, "threads must be an int in \\[1, 256\\], got 0"),
        ({"day_first": "yes"}, "day_first must be true or false"),
    ],
)
def test_bad_parameters_are_refused_by_name(params, message):
    with pytest.raises(BadInput, match=f"verifier ocr_fields: {message}"):
        OcrFieldsVerifier(**params)
