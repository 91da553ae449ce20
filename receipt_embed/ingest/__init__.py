"""Ingest: turn a manifest of captures into a checked, deduplicated, split dataset dir."""

from receipt_embed.ingest.manifest import ManifestError
from receipt_embed.ingest.pipeline import IngestResult, ingest

__all__ = ["IngestResult", "ManifestError", "ingest"]
