"""FAISS index dirs: build them (from a checkpoint or external embeddings), load, search."""

from receipt_embed.indexing.build import index_dataset, index_embeddings
from receipt_embed.indexing.factory import IndexBuildError, build_index
from receipt_embed.indexing.index_dir import IndexDir, IndexDirError, load_index_dir
from receipt_embed.indexing.pairs import all_pairs
from receipt_embed.indexing.search import search_images

__all__ = [
    "IndexBuildError",
    "IndexDir",
    "IndexDirError",
    "all_pairs",
    "build_index",
    "index_dataset",
    "index_embeddings",
    "load_index_dir",
    "search_images",
]
