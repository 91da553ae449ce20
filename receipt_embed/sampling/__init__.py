"""Batch samplers: which captures of which identities form a batch."""
