"""Contrastive training: the loop, checkpoints, and what is logged each epoch."""
