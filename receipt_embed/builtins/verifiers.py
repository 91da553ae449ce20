"""Built-in verifiers: the second stage that checks an embedding shortlist pair by pair."""

from __future__ import annotations

from receipt_embed.builtins import lazy_target
from receipt_embed.hookspecs import hookimpl


def build_geometric(**params):
    from receipt_embed.verification.geometric import GeometricVerifier

    return GeometricVerifier(**params)


def build_fields(**params):
    from receipt_embed.verification.fields import FieldsVerifier

    return FieldsVerifier(**params)


def build_ocr_fields(**params):
    from receipt_embed.verification.ocr import OcrFieldsVerifier

    return OcrFieldsVerifier(**params)


# their parameters' annotations, for the registry's checks
build_geometric.signature_target = lazy_target("receipt_embed.verification.geometric", "GeometricVerifier")
build_fields.signature_target = lazy_target("receipt_embed.verification.fields", "FieldsVerifier")
build_ocr_fields.signature_target = lazy_target("receipt_embed.verification.ocr", "OcrFieldsVerifier")


@hookimpl
def register_verifiers(register):
    register(
        "geometric",
        build_geometric,
        description="ORB keypoints and a MAGSAC++ homography: the page share its inliers cover "
        "(params: long_side, keypoints, ratio, reprojection_px)",
    )
    register(
        "fields",
        build_fields,
        description="printed date, total, receipt number and shop from manifest columns, normalised "
        "(params: fields, day_first)",
    )
    register(
        "ocr_fields",
        build_ocr_fields,
        description="printed date, total (and receipt number, shop) read from the capture by OCR "
        '(RapidOCR; pip install "receipt-embed[ocr]"; params: fields, day_first, long_side, min_score, threads)',
    )
