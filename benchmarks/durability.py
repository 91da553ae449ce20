"""What the guarantees cost: each safe write or checked read against the plain one it replaced,
timed in the same run on the same data.

    python benchmarks/durability.py [--vectors 100000] [--dim 128] [--captures 180] [--repeat 5]

Cases (median of --repeat, seconds):
- index dir write: ``write_index_dir`` (lock, staging sibling, fsync of every file, atomic
  exchange) against writing the same three files plus index.json straight into a folder;
- capture cache: ``cache_captures`` (regular-file check, byte cap, size/mtime check against
  manifest.jsonl, sha256 of the bytes read, header pixel check) against decoding the same files
  with Pillow directly;
- metrics append: ``fileio.append_line`` (one write + fsync) against a buffered append;
- lock: taking and releasing ``locking.write_lock``.
Run it alone: another process on the two cores distorts every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def median_time(function, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def index_write(work: Path, vectors: int, dim: int, repeat: int) -> dict:
    import faiss

    from receipt_embed.indexing.factory import build_index
    from receipt_embed.indexing.index_dir import write_index_dir

    rng = np.random.default_rng(0)
    embeddings = rng.standard_normal((vectors, dim)).astype(np.float32)
    embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
    items = [{"path": f"/data/r{i}.jpg", "receipt_id": f"r{i // 2}", "device": "phone"} for i in range(vectors)]
    built = build_index(embeddings, "Flat")
    source = {"kind": "embeddings", "embeddings": "x.npy", "embeddings_sha256": "0" * 64, "manifest": "m.csv"}

    def plain():
        out = work / "plain"
        out.mkdir(exist_ok=True)
        faiss.write_index(built.index, str(out / "index.faiss"))
        with open(out / "items.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(item) + "\n" for item in items)
        np.save(out / "embeddings.npy", embeddings)
        (out / "index.json").write_text(json.dumps({"count": vectors}))

    def safe():
        write_index_dir(work / "safe", built, embeddings, items, source, None, force=True)

    return {
        "plain_s": median_time(plain, repeat),
        "safe_s": median_time(safe, repeat),
        "bytes": sum(p.stat().st_size for p in (work / "safe").iterdir() if p.is_file()),
    }


def capture_cache(work: Path, captures: int, repeat: int) -> dict:
    from PIL import Image

    from receipt_embed.config import load_config
    from receipt_embed.data.dataset_dir import cache_captures, load_dataset_dir, select_split
    from receipt_embed.ingest import ingest

    samples = Path(__file__).resolve().parents[1] / "data_samples"
    ingest(samples, work / "dataset", force=True)
    chosen = select_split(load_dataset_dir(work / "dataset"), "all")
    rows = chosen.rows[:captures]
    subset = type(chosen)(rows, chosen.labels[: len(rows)], chosen.identities)
    size = (160, 80)
    settings = load_config().ingest

    def decode(path):
        with Image.open(path) as image:
            image.draft("RGB", (max(size), max(size)))
            return np.asarray(image.convert("RGB").resize((size[1], size[0]), Image.Resampling.BILINEAR))

    def plain():  # the same two decoding threads as the cache
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(decode, [row["path"] for row in rows]))

    def safe():
        cache_captures(subset, size, settings)

    return {"plain_s": median_time(plain, repeat), "safe_s": median_time(safe, repeat), "captures": len(rows)}


def metrics_append(work: Path, lines: int, repeat: int) -> dict:
    from receipt_embed.fileio import append_line

    line = json.dumps({"epoch": 1, "loss": 1.2345, "lr": 0.001, "val": {"recall_at_1": 0.5}})

    def plain():
        path = work / "plain.jsonl"
        for _ in range(lines):
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")

    def safe():
        path = work / "safe.jsonl"
        for _ in range(lines):
            append_line(path, line)

    return {"plain_s": median_time(plain, repeat) / lines, "safe_s": median_time(safe, repeat) / lines}


def lock_cycle(work: Path, cycles: int, repeat: int) -> dict:
    from receipt_embed.locking import write_lock

    def safe():
        for _ in range(cycles):
            with write_lock(work / "locked"):
                pass

    return {"safe_s": median_time(safe, repeat) / cycles}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vectors", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--captures", type=int, default=180)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as tmp:  # the project's disk, not a RAM-backed /tmp
        work = Path(tmp)
        results = {
            f"index dir write ({args.vectors} x {args.dim})": index_write(work, args.vectors, args.dim, args.repeat),
            f"capture cache ({args.captures} captures)": capture_cache(work, args.captures, args.repeat),
            "metrics.jsonl append (per line)": metrics_append(work, 50, args.repeat),
            "writer lock (take + release)": lock_cycle(work, 200, args.repeat),
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print("| case | plain | safe | ratio |")
    print("|---|---|---|---|")
    for name, r in results.items():
        plain = r.get("plain_s")
        ratio = f"{r['safe_s'] / plain:.2f}x" if plain else "-"
        shown = (lambda s: f"{s * 1000:.2f} ms") if r["safe_s"] < 1 else (lambda s: f"{s:.2f} s")
        print(f"| {name} | {shown(plain) if plain else '-'} | {shown(r['safe_s'])} | {ratio} |")


if __name__ == "__main__":
    main()
