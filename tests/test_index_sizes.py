"""Sizes that must not exhaust memory: the all-pairs sweep's chunks and pair count, and the
numbers in a --factory string (checked before FAISS allocates for them)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import faiss
import numpy as np
import pytest
from conftest import run_cli

from receipt_embed.indexing import IndexBuildError, all_pairs, build_index
from receipt_embed.indexing import pairs as search_module
from receipt_embed.indexing.factory import check_factory_sizes

REPO = Path(__file__).resolve().parents[1]


def _vectors(n, d=8, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _index(tmp_path, n, d=8):
    np.save(tmp_path / "x.npy", _vectors(n, d))
    with open(tmp_path / "m.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "receipt_id", "device"])
        writer.writerows([[f"img{i}.jpg", f"r{i // 2}", "d"] for i in range(n)])
    build = run_cli(
        "index", "--embeddings", tmp_path / "x.npy", "--manifest", tmp_path / "m.csv", "--out", tmp_path / "ix"
    )
    assert build.returncode == 0, build.stderr
    return tmp_path / "ix"


def _limited(script: str, margin_mib: int) -> subprocess.CompletedProcess:
    """``script`` in a new process whose address space may grow only ``margin_mib`` past what
    its imports took (``setup`` runs before the limit is set)."""
    head = textwrap.dedent(
        """
        import re, resource
        import numpy as np
        import faiss
        from receipt_embed.errors import BadInput
        import receipt_embed.indexing.search, receipt_embed.indexing.factory
        faiss.IndexFlatIP(8).range_search(np.zeros((2, 8), "float32"), 0.5)  # OpenMP and BLAS loaded
        vm = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read())[1]) * 1024
        """
    )
    limit = f"resource.setrlimit(resource.RLIMIT_AS, (vm + {margin_mib} * 2**20,) * 2)\n"
    return subprocess.run(
        [sys.executable, "-c", head + script.replace("# LIMIT\n", limit)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


# --- search --all-pairs ------------------------------------------------------------------------


def test_all_pairs_range_searches_stay_under_the_candidate_cap_with_the_same_pairs(monkeypatch):
    """Attack round 14: a 4096-query chunk's range search held 4096 x N candidates (gigabytes at a
    low threshold); chunks now hold at most CHUNK_RESULTS, and the pairs and their order are unchanged."""
    x = _vectors(300)
    expected = all_pairs(x, 0.2)
    sims = x @ x.T
    i, j = np.triu_indices(len(x), k=1)
    assert len(expected[0]) == int(np.sum(sims[i, j] >= 0.2 - 1e-6)) > 1000
    seen = []

    class Counting(faiss.IndexFlatIP):
        def range_search(self, queries, radius, **kwargs):
            seen.append(len(queries))
            return super().range_search(queries, radius, **kwargs)

    monkeypatch.setattr(faiss, "IndexFlatIP", Counting)
    monkeypatch.setattr(search_module, "CHUNK_RESULTS", 7 * len(x) + 5)
    chunked = all_pairs(x, 0.2)
    assert max(seen) == 7 and sum(seen) == len(x)
    for got, want in zip(chunked, expected):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_all_pairs_over_the_pair_limit_is_refused_and_at_it_is_not():
    """Attack round 14: every pair was kept and sorted in memory however many there were; the count
    is capped, with one line giving the count so far and saying to raise --threshold."""
    x = _vectors(15)  # 105 pairs at threshold -1
    assert len(all_pairs(x, -1.0, max_pairs=105)[0]) == 105
    with pytest.raises(search_module.TooManyPairs) as info:
        all_pairs(x, -1.0, chunk=4, max_pairs=60)
    message = str(info.value)
    assert message.startswith("--all-pairs --threshold -1.0: ") and "84 pairs among the first 8 of 15 items" in message
    assert "over the limit of 60 pairs; raise --threshold" in message and "\n" not in message


def test_all_pairs_cli_over_the_limit_exits_2_and_keeps_the_old_csv(tmp_path):
    """Attack round 14: `--threshold -1` over 5000 items (12.5 M pairs) is refused before any row is
    written; the pairs.csv of an earlier run stays as it was, with no temporary file beside it."""
    index = _index(tmp_path, 5000)
    pairs = tmp_path / "pairs.csv"
    first = run_cli("search", index, "--all-pairs", "--threshold", "0.999", "--out", pairs)
    assert first.returncode == 0, first.stderr
    before = pairs.read_bytes()
    started = time.monotonic()
    result = run_cli("search", index, "--all-pairs", "--threshold", "-1", "--out", pairs, "--force")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("Error: --all-pairs --threshold -1.0: ") and len(result.stderr.splitlines()) == 1
    assert "of 5000 items already, over the limit of 10000000 pairs; raise --threshold" in result.stderr
    assert time.monotonic() - started < 60
    assert pairs.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if "pairs" in p.name) == ["pairs.csv"]


def test_all_pairs_under_a_memory_limit_is_a_refusal_not_an_abort():
    """Attack round 14: under `ulimit -v` FAISS's std::bad_alloc inside its threads aborted the
    process (SIGABRT, no message); each range search's worst case is claimed first, so it is BadInput."""
    result = _limited(
        textwrap.dedent(
            """
            from receipt_embed.indexing.pairs import all_pairs
            x = np.random.default_rng(0).normal(size=(20000, 8)).astype(np.float32)
            # LIMIT
            try:
                all_pairs(x, -1.0)
            except BadInput as exc:
                print("refused:", exc)
                raise SystemExit(3)
            """
        ),
        150,
    )
    assert result.returncode == 3, (result.returncode, result.stderr[-2000:])
    assert "refused: out of memory in --all-pairs over 20000 items after " in result.stdout, result.stdout
    assert "raise the limit, or --threshold to keep fewer pairs" in result.stdout


# --- --factory sizes ---------------------------------------------------------------------------


def test_a_huge_ivf_list_count_is_refused_before_faiss_allocates():
    """Attack round 14: `--factory IVF30000000,Flat` on 24 vectors took 12 s and 5.2 GB before the
    "cannot train" refusal; the count is read from the string, so it is refused at once, allocating nothing."""
    result = _limited(
        textwrap.dedent(
            """
            import time
            from receipt_embed.indexing import build_index
            x = np.random.default_rng(0).normal(size=(24, 16)).astype(np.float32)
            # LIMIT
            for factory in ("IVF30000000,Flat", "IVF2000000000,Flat", "IVF1024_HNSW32,PQ8", "HNSW100000000"):
                started = time.monotonic()
                try:
                    build_index(x, factory)
                except BadInput as exc:
                    print(f"{time.monotonic() - started:.3f} {exc}")
            """
        ),
        100,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 4, result.stdout
    assert all(float(line.split()[0]) < 0.5 for line in lines), result.stdout
    assert lines[0].endswith(
        "IVF30000000,Flat: cannot train 30000000 IVF lists on 24 training vectors; use fewer lists (e.g. IVF1) or Flat"
    )
    assert "IVF2000000000,Flat: cannot train 2000000000 IVF lists" in lines[1]
    assert "IVF1024_HNSW32,PQ8: cannot train 1024 IVF lists" in lines[2]
    assert "HNSW100000000: HNSW100000000 is outside HNSW2 to HNSW256" in lines[3]


@pytest.mark.parametrize(
    "factory, message",
    [
        ("IVF0,Flat", "an IVF index needs at least 1 list"),
        ("IVF" + "9" * 5000 + ",Flat", "cannot train " + "9" * 20 + "... (5000 characters) IVF lists"),
        ("IMI2x16,Flat", "cannot train 4294967296 IVF lists on 300 training vectors"),
        ("HNSW0", "HNSW0 is outside HNSW2 to HNSW256"),  # FAISS aborts the process adding to it
        ("HNSW1", "HNSW1 is outside HNSW2 to HNSW256"),  # and segfaults on this one
        ("HNSW257", "HNSW257 is outside HNSW2 to HNSW256"),
        ("NSG4", "NSG4 is outside NSG8 to NSG256"),  # FAISS never finishes building it
        ("NSG100000000", "NSG100000000 is outside NSG8 to NSG256"),
        ("PQ8x30", "30-bit PQ codes are refused (at most 16"),
        ("PQ8x10", "with 1024-entry codebooks needs at least 1024 training vectors, got 300"),
        ("IVF4,PQ64", "PQ64 splits each vector into 64 parts, more than its 16 dimensions"),
        ("RQ1x30", "30-bit residual codes are refused"),
        ("PCA100000000,Flat", "PCA100000000 maps dim 16 to 100000000; give an output dim from 1 to 64"),
        ("RR0,Flat", "RR0 maps dim 16 to 0"),
        ("OPQ8_100000000,PQ8", "OPQ8_100000000 maps dim 16 to 100000000"),
        # attack round 15: FAISS segfaults on a zero-sized code, and trains LSQ200x8 for minutes
        ("RQ0x8", "RQ0x8 has an empty code"),
        ("RQ1x0", "RQ1x0 has an empty code"),
        ("LSQ0x8", "LSQ0x8 has an empty code"),
        ("IVF2,LSQ1x0", "LSQ1x0 has an empty code"),
        ("IVF2,PQ8x0", "PQ8x0 has an empty code"),
        ("PQ0", "PQ0 has an empty code"),
        ("LSQ200x8", "LSQ200x8 has 200 codebooks; at most 32 are built"),
        ("RQ20x8_20x8", "has 40 codebooks; at most 32"),
        # attack round 21 L1: NSG160 on 180 vectors never finished and ignored SIGTERM/SIGINT
        ("NSG160", "NSG160 needs at least 320 vectors (twice its degree), got 300; use NSG32"),
        # attack round 21 L2: FAISS aborts the process (SIGABRT) searching an IVF inside Refine
        ("IVF4,SQ8,Refine(IVF2,Flat)", "a Refine(...) stage re-ranks with stored codes, so it must be Flat"),
        ("IVF4,PQ4,Refine(HNSW8)", "not HNSW8"),
        # attack round 27 F1: FAISS's NNDescent aborted the process (exit 134) building NSG16 on 120 vectors
        ("NSG16", "NSG16: an NSG graph needs at least 500 vectors, got 300"),
    ],
)
def test_factory_sizes_are_refused_in_one_line_naming_the_factory(factory, message):
    """Attack round 14: sizes in a factory string allocated gigabytes (IVF lists, PQ codebooks, OPQ
    matrices, HNSW links), or crashed or hung FAISS, before any check of ours ran."""
    started = time.monotonic()
    with pytest.raises(IndexBuildError) as info:
        build_index(_vectors(300, 16), factory)
    text = str(info.value)
    assert message in text and "\n" not in text and time.monotonic() - started < 0.5
    assert text.startswith(factory[:200] + ("... (5008 characters): " if len(factory) > 200 else ": "))


@pytest.mark.parametrize(
    "factory",
    [
        "Flat",
        "IVF8,Flat",
        "HNSW16",
        "HNSW32,SQ8",
        "IVF4,PQ4x4fs",
        "PCAR8,IVF4,PQ4x4",
        "OPQ4_16,IVF4,PQ4x4",
        "RR32,Flat",
        "NSG32",
        "IVF4,SQ8,Refine(SQ8)",
        "IVF4,PQ4x4,Refine(Flat)",
    ],
)
def test_usual_factories_pass_the_size_check(factory):
    """The size check refuses only what would fail or exhaust memory: the usual strings pass."""
    check_factory_sizes(factory, 900, 100_000, 16)


def test_nsg_on_few_vectors_is_refused_before_faiss_aborts_the_index_command(tmp_path):
    """Attack round 27 F1: `index --embeddings` with NSG16 on 120 vectors died in a FAISS assertion
    (exit 134) and left its lock; now one line, exit 2, and no lock left behind."""
    np.save(tmp_path / "e.npy", _vectors(120, 8))
    rows = "".join(f"img{i}.png,r{i // 3},d{i % 3}\n" for i in range(120))
    (tmp_path / "m.csv").write_text("path,receipt_id,device\n" + rows)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "receipt_embed",
            "index",
            "--embeddings",
            "e.npy",
            "--manifest",
            "m.csv",
            "--out",
            "idx",
            "--factory",
            "NSG16",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "NSG16: an NSG graph needs at least 500 vectors, got 120" in result.stderr
    assert not (tmp_path / "idx").exists() and not (tmp_path / ".idx.lock").exists()


def test_index_with_too_many_lists_is_refused_at_once_and_keeps_the_old_index(tmp_path):
    """Attack round 14: the CLI path of the IVF refusal: one line, exit 2, well under the 5 GB that
    FAISS's lists took, and the index dir of an earlier run untouched (also with --force)."""
    index = _index(tmp_path, 24)
    before = {p.name: p.read_bytes() for p in index.iterdir()}
    # a parent of its own, so the peak memory measured is this one command's
    measured = "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; " + (
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", measured, sys.executable, "-m", "receipt_embed", "index",
         "--embeddings", str(tmp_path / "x.npy"), "--manifest", str(tmp_path / "m.csv"), "--out", str(index),
         "--factory", "IVF30000000,Flat", "--force"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    *lines, peak_kib = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "IVF30000000,Flat: cannot train 30000000 IVF lists on 24 training vectors" in lines[0]
    assert int(peak_kib) < 2 * 2**20, f"peak RSS {int(peak_kib) // 1024} MiB"
    assert {p.name: p.read_bytes() for p in index.iterdir()} == before


TOO_FEW = "; index more vectors, or use Flat, HNSW32 or an SQ8 index"


@pytest.mark.parametrize(
    "dim, n, factory, message",
    [
        (
            1024,
            180,
            "IVF2,RQ4x8",
            "IVF2,RQ4x8: its residual quantizer needs at least 1024 training vectors (one per dimension of the "
            "1024-dimensional vectors it codes), got 180 training vectors" + TOO_FEW,
        ),
        (
            16,
            300,
            "RQ1x10",
            "RQ1x10: its residual quantizer needs at least 1024 training vectors (one per entry of its "
            "1024-entry codebooks), got 300 training vectors" + TOO_FEW,
        ),
        (
            64,
            20,
            "IVF2,PRQ2x1x4",
            "IVF2,PRQ2x1x4: its residual quantizer needs at least 32 training vectors (one per dimension of the "
            "32-dimensional vectors it codes), got 20 training vectors" + TOO_FEW,
        ),
        (
            64,
            100,
            "OPQ4_32,IVF2,PQ4x4",
            "OPQ4_32,IVF2,PQ4x4: its OPQ stage needs at least 256 training vectors (it trains 256-entry PQ "
            "codebooks), got 100 training vectors" + TOO_FEW,
        ),
        (
            64,
            40,
            "PCAR48,IVF2,Flat",
            "PCAR48,IVF2,Flat: its PCA stage needs at least 48 training vectors (one per output dimension of its "
            "PCA to 48), got 40 training vectors" + TOO_FEW,
        ),
        (
            16,
            300,
            "ITQ32,Flat",
            "ITQ32,Flat: its ITQ stage cannot output 32 dimensions from 16: a PCA keeps at most as many as it is "
            "given; give it an output dim of at most 16 (RR32 rotates into more)",
        ),
        (  # a need no check of ours knows (the nested quantizer trains on the 2 lists): said, with what helps
            16,
            300,
            "IVF2(RQ1x4),Flat",
            "training IVF2(RQ1x4),Flat failed on 300 training vectors of dim 16: a PCA inside it got fewer than the "
            "16 vectors it needs to output 16 dimensions (PCA matrix cannot output 16 dimensions from 16); if that "
            "is too few for one of its stages, index more vectors, use smaller codes, or use Flat, HNSW32 or an "
            "SQ8 index",
        ),
    ],
)
def test_training_needs_faiss_words_wrongly_are_told_in_our_terms(dim, n, factory, message):
    """Attack round 19 J11: `--factory IVF2,RQ4x8` on 180 vectors of dim 1024 said only FAISS's "PCA
    matrix cannot output 1024 dimensions from 1024" (there is no PCA in the factory): residual
    quantizers, PCA, ITQ and OPQ stages say how many training vectors they need, like PQ does."""
    with pytest.raises(IndexBuildError) as info:
        build_index(_vectors(n, dim), factory)
    assert str(info.value) == message


def test_training_needs_are_refused_before_captures_are_embedded_and_met_needs_build():
    """Attack round 19 J11: the same need is refused by check_factory (before `index --checkpoint`
    embeds anything), names a --train-size sample as such, and a sample that meets it builds."""
    from receipt_embed.indexing.factory import check_factory

    with pytest.raises(IndexBuildError, match=r"^RQ1x4: its residual quantizer needs at least 64 training vectors"):
        check_factory("RQ1x4", 60, None, 64)
    with pytest.raises(IndexBuildError) as info:
        build_index(_vectors(300, 64), "RQ1x4", train_size=50)
    assert str(info.value).endswith(
        "got 50 training vectors (sampled from 300); raise --train-size (or index more vectors), or use Flat, "
        "HNSW32 or an SQ8 index"
    )
    assert build_index(_vectors(64, 64), "RQ1x4").index.ntotal == 64
    assert build_index(_vectors(32, 64), "IVF2,PRQ2x1x4").index.ntotal == 32


def test_a_residual_factory_on_too_few_vectors_is_one_line_from_the_cli(tmp_path):
    """Attack round 19 J11: the CLI path of the report's case: exit 2, one line in our terms, no index."""
    np.save(tmp_path / "x.npy", _vectors(180, 1024))
    with open(tmp_path / "m.csv", "w", newline="") as handle:
        csv.writer(handle).writerows(
            [["path", "receipt_id", "device"], *([f"i{i}.jpg", f"r{i}", "d"] for i in range(180))]
        )
    result = run_cli(
        "index", "--embeddings", tmp_path / "x.npy", "--manifest", tmp_path / "m.csv", "--out", tmp_path / "ix",
        "-q", "--factory", "IVF2,RQ4x8",
    )  # fmt: skip
    assert result.returncode == 2 and not (tmp_path / "ix").exists()
    assert result.stderr == (
        "Error: IVF2,RQ4x8: its residual quantizer needs at least 1024 training vectors (one per dimension of "
        "the 1024-dimensional vectors it codes), got 180 training vectors" + TOO_FEW + "\n"
    )
