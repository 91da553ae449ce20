"""Loading a dataset dir for training and embedding: captures, decoded-image cache, views."""
