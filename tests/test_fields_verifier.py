"""The fields verifier: printed values written in the ways real receipts and OCR write them compare
equal after normalising, different receipts differ, and a capture missing a field is no evidence."""

from __future__ import annotations

import numpy as np
import pytest

from receipt_embed.errors import BadInput
from receipt_embed.verification.fields import (
    FieldsVerifier,
    normalise_amount,
    normalise_date,
    normalise_number,
    normalise_text,
)


@pytest.mark.parametrize(
    ("printed", "normal"),
    [
        ("25/12/2018", "2018-12-25"),
        ("25-12-18", "2018-12-25"),
        ("25.12.2018", "2018-12-25"),
        ("2018-12-25", "2018-12-25"),
        ("2018/12/25 14:02", "2018-12-25"),
        ("DATE: 25/12/2018 10:31:22 AM", "2018-12-25"),
        ("25 Dec 2018", "2018-12-25"),
        ("25-DEC-18", "2018-12-25"),
        ("Dec 25, 2018", "2018-12-25"),
        ("December 25th 2018", "2018-12-25"),
        ("5/1/2019", "2019-01-05"),
        ("01/02/99", "1999-02-01"),
        ("31/02/2018", "2018-02-31"),  # not a calendar check: the same wrong print compares equal
        ("20180428", "2018-04-28"),  # compact, year first (SROIE prints both)
        ("25032018", "2018-03-25"),  # compact, day first
        ("Date:25032018", "2018-03-25"),
        ("123456789", ""),
        ("32/12/2018", ""),
        ("13/13/2018", ""),
        ("no date here", ""),
        ("", ""),
    ],
)
def test_printed_dates_normalise_day_first(printed, normal):
    assert normalise_date(printed) == normal


def test_month_first_dates_when_asked():
    assert normalise_date("12/25/2018", day_first=False) == "2018-12-25"
    assert normalise_date("12/25/2018") == "2018-12-25"  # day first, month 25 does not exist: month first then
    assert normalise_date("25/12/2018", day_first=False) == "2018-12-25"  # and the other way round
    assert normalise_date("25/13/2018") == ""  # in neither order a date
    assert normalise_date("2018/25/12") == ""  # year first is never swapped
    assert normalise_date("2018-12-25", day_first=False) == "2018-12-25"  # year first is unambiguous


@pytest.mark.parametrize(
    ("printed", "normal"),
    [
        ("9.00", "9"),
        ("9", "9"),
        ("RM 9.00", "9"),
        ("RM9.50", "9.5"),
        ("$1,234.50", "1234.5"),
        ("1.234,50 EUR", "1234.5"),
        ("9,00", "9"),
        ("1,234", "1234"),
        ("1.234.567", "1234567"),
        ("TOTAL: 31.00", "31"),
        ("0.00", "0"),
        ("-3.20", "-3.2"),
        ("12.", "12"),
        ("n/a", ""),
    ],
)
def test_printed_amounts_normalise(printed, normal):
    assert normalise_amount(printed) == normal


@pytest.mark.parametrize(
    ("printed", "normal"),
    [("No. 000123", "123"), ("000123", "123"), ("#123", "123"), ("inv-0042a", "INV42A"), ("CS 10012", "CS10012")],
)
def test_receipt_numbers_normalise(printed, normal):
    assert normalise_number(printed) == normal


def test_shop_names_normalise():
    assert normalise_text("Book Ta.K (Taman Daya) Sdn Bhd") == normalise_text("BOOK TA K  TAMAN DAYA SDN BHD")
    assert normalise_text("ＡＢＣ Mart") == "ABC MART"  # full-width letters (NFKC)


def _scored(verifier, a: dict, b: dict) -> dict:
    return verifier.score(verifier.extract(None, a), verifier.extract(None, b))


def test_one_receipt_agrees_a_sibling_differs_and_no_shared_field_is_no_evidence():
    verifier = FieldsVerifier()
    receipt = {"merchant": "Book Ta.K", "date": "25/12/2018", "total": "RM 9.00", "receipt_number": "No. 0042"}
    rewritten = {"merchant": "BOOK TA K", "date": "2018-12-25", "total": "9", "receipt_number": "42"}
    assert _scored(verifier, receipt, rewritten) == {
        "score": 1.0,
        "agree": ["date", "total", "receipt_number", "merchant"],
        "differ": [],
        "abstain": False,
        "veto": False,
    }
    sibling = {**receipt, "date": "26/12/2018", "total": "12.40"}
    assert _scored(verifier, receipt, sibling) == {
        "score": 0.0,
        "agree": ["receipt_number", "merchant"],
        "differ": ["date", "total"],
        "abstain": False,
        "veto": True,  # a differing printed field: another receipt, whatever the images say
        "read_as": ["date 2018-12-25 / 2018-12-26", "total 9 / 12.4"],  # the normalised values that differ
    }
    assert _scored(FieldsVerifier(veto=False), receipt, sibling)["veto"] is False
    # no shared field: no evidence, left out of the verified score
    assert _scored(verifier, receipt, {"path": "x.jpg"}) == {
        "score": 0.5,
        "agree": [],
        "differ": [],
        "abstain": True,
        "veto": False,
    }
    assert _scored(verifier, {"date": "not a date"}, {"date": "25/12/2018"})["score"] == 0.5  # unreadable: no evidence


def test_the_fields_and_how_dates_read_are_parameters():
    verifier = FieldsVerifier(fields=["total", "cashier"], day_first=False)
    data = verifier.extract(None, {"total": "9.00", "cashier": " Ana ", "date": "1/2/2019"})
    assert data["values"].tolist() == ["9", "ANA"] and data["values"].dtype.kind == "U"
    assert FieldsVerifier(day_first=False).extract(None, {"date": "1/2/2019"})["values"][0] == "2019-01-02"
    with pytest.raises(BadInput, match="fields must be a non-empty list of column names, got 'date'"):
        FieldsVerifier(fields="date")
    with pytest.raises(BadInput, match="fields must be a non-empty list"):
        FieldsVerifier(fields=[])
    with pytest.raises(BadInput, match="day_first must be true or false, got 'yes'"):
        FieldsVerifier(day_first="yes")
    assert np.array_equal(FieldsVerifier().extract(None, None)["values"], np.array(["", "", "", ""]))


def test_index_is_told_which_fields_the_captures_lack():
    """check_rows, run by `index --verify fields` before extracting: a field no capture carries is
    never compared, a partly filled one judges fewer pairs, and none at all is refused."""
    from receipt_embed.errors import BadInput

    rows = [{"path": "a.jpg", "date": "25/12/2018", "total": "9.00"}, {"path": "b.jpg", "date": "soon", "total": "9"}]
    assert FieldsVerifier().check_rows(rows) == [
        "verifier fields: 1 of 2 captures have no date value that reads as a date; those pairs are judged on "
        "their other fields",
        "verifier fields: no capture has a receipt_number value, so receipt_number is never compared",
        "verifier fields: no capture has a merchant value, so merchant is never compared",
    ]
    assert FieldsVerifier(fields=["total"]).check_rows(rows) == []
    with pytest.raises(
        BadInput,
        match=r"no capture has a usable value in shop, so it could only abstain; the captures' columns are date, path, total",
    ):
        FieldsVerifier(fields=["shop"]).check_rows(rows)
