"""FAISS index build time, memory, throughput, latency and recall@10 at 1e5 and 1e6 vectors.

    python benchmarks/index.py [--sizes 100000 1000000] [--dim 512] \
        [--factories Flat HNSW32 "IVF4096,PQ64"] [--target-recall 0.95] [--json results.jsonl]

Vectors imitate receipt embeddings: captures of one receipt lie close together (a receipt
position plus capture noise), receipts of one merchant cluster, and everything lives near a
64-dimensional subspace of the 512 dimensions, as trained embeddings do. Queries are *new* captures of indexed receipts (the
duplicate lookup); ground truth is exact inner-product search over all vectors.

Each (size, factory) case runs in its own process, through `receipt_embed.indexing.build_index`
(train on a sample, add, raise nprobe/efSearch until recall@10 on indexed vectors reaches
--target-recall), and reports:
- build: train + add seconds (tuning reported separately);
- index size on disk and the peak extra RSS of the build (VmHWM reset before it);
- throughput: one batched search of all queries, k = 10, on every core;
- latency: single-query searches one after another, p50 / p99;
- recall@10 of the held-out queries against exact search.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MERCHANTS, CAPTURES, LATENT = 2000, 3, 64


def _basis(dim: int, seed: int) -> np.ndarray:
    """A fixed random map from the latent space into the embedding space."""
    return np.random.default_rng([seed, 0]).normal(size=(LATENT, dim)).astype(np.float32) / np.sqrt(LATENT)


def receipt_latents(receipts: np.ndarray, seed: int) -> np.ndarray:
    """A receipt's latent position is a function of its number, so queries can recreate it:
    its merchant's position plus its own offset."""
    merchants = np.random.default_rng([seed, 3]).normal(size=(MERCHANTS, LATENT)).astype(np.float32)
    out = np.empty((len(receipts), LATENT), np.float32)
    for i, receipt in enumerate(receipts.tolist()):
        r = np.random.default_rng([seed, 1, receipt])
        out[i] = merchants[r.integers(MERCHANTS)] + 0.7 * r.normal(size=LATENT)
    return out


def _captures(latents: np.ndarray, basis: np.ndarray, rng) -> np.ndarray:
    """Capture noise in the latent space plus a little isotropic noise in all dimensions."""
    x = (latents + 0.25 * rng.normal(size=latents.shape)) @ basis
    x += 0.02 * rng.normal(size=x.shape)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def make_vectors(n: int, dim: int, seed: int = 0, chunk: int = 100_000) -> np.ndarray:
    """n captures (3 per receipt) of n/3 receipts spread over MERCHANTS merchants, normalised.

    Real embeddings occupy far fewer directions than their dimension (an effective rank of a
    few dozen is typical), so the vectors live near a LATENT-dimensional subspace."""
    rng = np.random.default_rng([seed, 4])
    basis = _basis(dim, seed)
    out = np.empty((n, dim), np.float32)
    for start in range(0, n, chunk):
        rows = np.arange(start, min(n, start + chunk))
        out[rows] = _captures(receipt_latents(rows // CAPTURES, seed), basis, rng)
    return out


def make_queries(n: int, dim: int, count: int, seed: int = 0) -> np.ndarray:
    """New captures of indexed receipts: the duplicate lookup."""
    rng = np.random.default_rng([seed, 2])
    receipts = rng.choice(n // CAPTURES, count, replace=False)
    return _captures(receipt_latents(receipts, seed), _basis(dim, seed), rng).astype(np.float32)


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def ground_truth(n: int, dim: int, queries: int, cache: Path) -> np.ndarray:
    path = cache / f"truth_{n}_{dim}_{queries}.npy"
    if not path.exists():
        import faiss

        x = make_vectors(n, dim)
        flat = faiss.IndexFlatIP(dim)
        flat.add(x)
        np.save(path, flat.search(make_queries(n, dim, queries), 10)[1])
    return np.load(path)


def run_case(n: int, dim: int, factory: str, queries: int, latency_queries: int, target: float, cache: Path) -> dict:
    import faiss

    from receipt_embed.indexing import build_index

    truth = ground_truth(n, dim, queries, cache)
    x = make_vectors(n, dim)
    q = make_queries(n, dim, queries)
    before = _rss_kb("VmRSS")
    _reset_peak()
    built = build_index(x, factory, target_recall=target)
    peak_extra_mb = (_rss_kb("VmHWM") - before) / 1024
    index = built.index
    with tempfile.NamedTemporaryFile(dir=cache, suffix=".faiss") as handle:
        faiss.write_index(index, handle.name)
        size_mb = os.path.getsize(handle.name) / 2**20
    started = time.perf_counter()
    _, found = index.search(q, 10)
    batch_s = time.perf_counter() - started
    recall = float(np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth)]))
    latencies = []
    for row in range(min(latency_queries, len(q))):
        started = time.perf_counter()
        index.search(q[row : row + 1], 10)
        latencies.append(time.perf_counter() - started)
    return {
        "n": n,
        "dim": dim,
        "factory": factory,
        "search_params": built.search_params,
        "build_s": built.build_seconds,
        "tune_s": built.tune_seconds,
        "index_mb": round(size_mb, 1),
        "build_peak_extra_mb": round(peak_extra_mb, 1),
        "qps": round(len(q) / batch_s, 1),
        "p50_ms": round(1000 * float(np.percentile(latencies, 50)), 3),
        "p99_ms": round(1000 * float(np.percentile(latencies, 99)), 3),
        "recall_at_10": round(recall, 4),
        "tune_recall_at_10": built.recall_at_10,
        "threads": faiss.omp_get_max_threads(),
    }


def report(results: list[dict]) -> str:
    lines = [
        "| vectors | factory | search params | build s | index MB | build peak extra MB | queries/s (batch) "
        "| p50 ms | p99 ms | recall@10 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['n']:,} | {r['factory']} | {r['error']} | | | | | | | |")
            continue
        lines.append(
            f"| {r['n']:,} | {r['factory']} | {r['search_params'] or '-'} | {r['build_s']:.1f} | "
            f"{r['index_mb']:.0f} | {r['build_peak_extra_mb']:.0f} | {r['qps']:,.0f} | {r['p50_ms']:.2f} | "
            f"{r['p99_ms']:.2f} | {r['recall_at_10']:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--factories", nargs="+", default=["Flat", "HNSW32", "IVF4096,PQ64"])
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--latency-queries", type=int, default=200)
    parser.add_argument("--target-recall", type=float, default=0.95)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per case")
    parser.add_argument("--json", default=None, help="append one JSON line per case")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # "n,factory": run one case here
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        n, factory = args.case.split(",", 1)
        result = run_case(
            int(n), args.dim, factory, args.queries, args.latency_queries, args.target_recall, Path(args.cache)
        )
        print(json.dumps(result))
        return
    results = []
    with tempfile.TemporaryDirectory() as cache:
        for n in args.sizes:
            for factory in args.factories:
                command = [
                    sys.executable,
                    __file__,
                    "--case",
                    f"{n},{factory}",
                    "--cache",
                    cache,
                    "--dim",
                    str(args.dim),
                    "--queries",
                    str(args.queries),
                    "--latency-queries",
                    str(args.latency_queries),
                    "--target-recall",
                    str(args.target_recall),
                ]
                try:
                    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
                    result = (
                        json.loads(done.stdout.strip().splitlines()[-1])
                        if done.returncode == 0
                        else {"n": n, "factory": factory, "error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
                    )
                except subprocess.TimeoutExpired:
                    result = {"n": n, "factory": factory, "error": f"over {args.timeout:.0f} s"}
                print(json.dumps(result), flush=True)
                results.append(result)
                if args.json:
                    with open(args.json, "a") as handle:
                        handle.write(json.dumps(result) + "\n")
    print(report(results))


if __name__ == "__main__":
    main()
