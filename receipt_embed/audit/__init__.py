"""The shortcut audit: figures, report."""
