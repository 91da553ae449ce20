"""Verification: the second stage that checks an embedding shortlist pair by pair (verifier plugins).

``geometric``: local features and a robust homography (receipt_embed.verification.geometric).
"""
