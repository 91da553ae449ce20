"""Encoders (backbones producing the features that get indexed)."""
