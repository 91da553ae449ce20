"""Retrieval figures and embedding diagnostics, shared by training and the audit."""
