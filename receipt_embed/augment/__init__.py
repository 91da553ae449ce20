"""Augmentation presets (albumentations pipelines)."""
