"""Verification: the second stage that checks an embedding shortlist pair by pair (verifier plugins).

``geometric``: local features and a robust homography (receipt_embed.verification.geometric).
``fields``: printed date, total, receipt number and shop from manifest columns (receipt_embed.verification.fields).
``ocr_fields``: the same fields read from the capture by OCR, an optional extra (receipt_embed.verification.ocr).
"""
