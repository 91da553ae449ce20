"""index --verify stores each verifier's per-capture data in the index dir (checksummed), and
search --verify re-ranks the embedding's shortlist by it: real FAISS index dirs, real captures."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import run_cli, train_tiny
from PIL import Image

from receipt_embed.errors import BadInput
from receipt_embed.indexing import IndexDirError, load_index_dir
from receipt_embed.indexing.index_dir import META_KEYS, sha256_file
from receipt_embed.indexing.verifier_data import pack
from receipt_embed.verification.geometric import GeometricVerifier


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("verify"))


@pytest.fixture(scope="module")
def verified_index(trained, tmp_path_factory):
    dataset, checkpoint = trained
    out = tmp_path_factory.mktemp("vix") / "heldout"
    result = run_cli(
        "index", "--checkpoint", checkpoint, "--data", dataset, "--split", "heldout", "--out", out,
        "--verify", "geometric", "--verify-set", "geometric.keypoints=800", "-q",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return out


def test_index_verify_stores_what_extract_gives_each_capture(verified_index):
    meta = json.loads((verified_index / "index.json").read_text())
    assert set(meta) == META_KEYS
    record = meta["verifiers"]["geometric"]
    assert record["params"] == {"keypoints": 800} and record["plugin"] == "builtin.verifiers"
    assert record["file"] == "verifier-geometric.npz" and record["extract_seconds"] > 0
    stored = verified_index / "verifier-geometric.npz"
    assert meta["files"][record["file"]] == {"sha256": sha256_file(stored), "bytes": stored.stat().st_size}
    index = load_index_dir(verified_index)
    data = index.verifiers["geometric"]
    assert data.count == index.count
    assert record["bytes_per_item"] == round(data.nbytes() / index.count)
    verifier = GeometricVerifier(keypoints=800)
    for row in (0, index.count - 1):
        fresh = verifier.extract(np.asarray(Image.open(index.items[row]["path"]).convert("RGB")))
        kept = data.item(row)
        assert kept.keys() == fresh.keys()
        for key in fresh:  # the stored arrays are the extracted ones, exactly
            assert kept[key].dtype == fresh[key].dtype and np.array_equal(kept[key], fresh[key]), key


def test_search_verify_reranks_the_shortlist_by_the_verified_score(cli, verified_index):
    items = load_index_dir(verified_index).items
    query = items[4]["path"]
    plain = json.loads(cli("search", verified_index, query, "--k", "6", "--json").stdout)[0]["neighbours"]
    result = cli("search", verified_index, query, "--verify", "--shortlist", "6", "--k", "6", "--json")
    assert result.returncode == 0, result.stderr
    hits = json.loads(result.stdout)[0]["neighbours"]
    assert sorted(h["row"] for h in hits) == sorted(h["row"] for h in plain)  # the same shortlist, re-ranked
    scores = [h["verified"]["score"] for h in hits]
    assert scores == sorted(scores, reverse=True)
    for hit in hits:
        geometric = hit["verified"]["geometric"]
        assert hit["verified"]["score"] == geometric["score"]  # one verifier: its score is the verified score
        assert 0 <= geometric["score"] <= 1 and geometric["score"] * 32 == pytest.approx(round(geometric["score"] * 32))
    assert hits[0]["row"] == 4 and hits[0]["same_file"]  # itself: every keypoint an inlier
    assert hits[0]["verified"]["geometric"]["inliers"] == hits[0]["verified"]["geometric"]["matches"]
    top = cli("search", verified_index, query, "--verify", "--shortlist", "6", "--k", "2", "--json")
    assert [h["row"] for h in json.loads(top.stdout)[0]["neighbours"]] == [h["row"] for h in hits[:2]]

    table = cli("search", verified_index, query, "--verify", "--k", "2", "--threshold", "0.5")
    assert f"DUPLICATE of receipt {items[4]['receipt_id']} (verified score " in table.stdout
    assert "verified " in table.stdout and "geometric " in table.stdout and "inliers " in table.stdout
    above = round(hits[0]["verified"]["score"] + 0.001, 3)  # just above the best verified score
    none = cli("search", verified_index, query, "--verify", "--k", "1", "--threshold", str(above))
    assert f"no duplicate (best verified score below {above})" in none.stdout


def test_verify_options_are_refused_where_they_do_not_apply(cli, trained, verified_index, tmp_path):
    dataset, checkpoint = trained
    query = load_index_dir(verified_index).items[0]["path"]
    plain = tmp_path / "plain"
    made = cli("index", "--checkpoint", checkpoint, "--data", dataset, "--split", "heldout", "--out", plain, "-q")
    assert made.returncode == 0, made.stderr
    said = cli("search", plain, query, "--verify")
    assert said.returncode == 2 and "holds no verifier data: build it with `receipt-embed index" in said.stderr
    said = cli("search", verified_index, query, "--verify", "--verifier", "fields")
    assert said.returncode == 2 and "holds no data for verifier 'fields' (it holds geometric)" in said.stderr
    said = cli("search", verified_index, query, "--shortlist", "5")
    assert said.returncode == 2 and "--shortlist goes with --verify" in said.stderr
    said = cli("search", verified_index, "--all-pairs", "--threshold", "0.9", "--out", tmp_path / "p.csv", "--verify")
    assert said.returncode == 2 and "--verify apply to image queries" in said.stderr
    base = ("index", "--checkpoint", checkpoint, "--data", dataset, "--out", tmp_path / "x")
    said = cli(*base, "--verify", "geometrc")
    assert said.returncode == 2 and "unknown verifier 'geometrc'" in said.stderr and "'geometric'" in said.stderr
    said = cli(*base, "--verify-set", "geometric.keypoints=900")
    assert said.returncode == 2 and "add --verify geometric" in said.stderr
    said = cli(*base, "--verify", "geometric", "--verify-set", "geometric.ratio=2")
    assert said.returncode == 2 and "ratio must be in (0, 1], got 2" in said.stderr
    said = cli(*base, "--verify", "geometric", "--shard", "0/2")
    assert said.returncode == 2 and "--verify reads the captures' images" in said.stderr
    assert not (tmp_path / "x").exists()


def _rewrite_checksum(index_dir, name):
    meta = json.loads((index_dir / "index.json").read_text())
    meta["files"][name] = {"sha256": sha256_file(index_dir / name), "bytes": (index_dir / name).stat().st_size}
    (index_dir / "index.json").write_text(json.dumps(meta))


def test_a_damaged_verifier_file_is_named_not_used(verified_index, tmp_path):
    broken = tmp_path / "flip"
    shutil.copytree(verified_index, broken)
    data = bytearray((broken / "verifier-geometric.npz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (broken / "verifier-geometric.npz").write_bytes(bytes(data))
    with pytest.raises(IndexDirError, match="verifier-geometric.npz does not match the sha256"):
        load_index_dir(broken)

    shifted = tmp_path / "offsets"  # checksums made to agree, offsets that do not fit the items
    shutil.copytree(verified_index, shifted)
    with np.load(shifted / "verifier-geometric.npz") as stored:
        contents = {key: stored[key] for key in stored.files}
    contents["points@offsets"] = contents["points@offsets"][:-1]
    np.savez(shifted / "verifier-geometric.npz", **contents)
    _rewrite_checksum(shifted, "verifier-geometric.npz")
    with pytest.raises(IndexDirError, match="the offsets of 'points' do not describe"):
        load_index_dir(shifted)

    renamed = tmp_path / "renamed"
    shutil.copytree(verified_index, renamed)
    meta = json.loads((renamed / "index.json").read_text())
    meta["verifiers"]["geometric"]["file"] = "../elsewhere.npz"
    (renamed / "index.json").write_text(json.dumps(meta))
    with pytest.raises(
        IndexDirError, match='verifiers.geometric is .*expected a record whose file is "verifier-geometric.npz"'
    ):
        load_index_dir(renamed)

    missing = tmp_path / "missing"
    shutil.copytree(verified_index, missing)
    (missing / "verifier-geometric.npz").unlink()
    with pytest.raises(IndexDirError, match="verifier-geometric.npz is missing"):
        load_index_dir(missing)


def test_items_that_disagree_on_their_arrays_are_refused_naming_both():
    names = ["a.jpg", "b.jpg"]
    with pytest.raises(BadInput, match=r"gave b.jpg the keys \['x'\], but a.jpg \['points'\]"):
        pack("v", [{"points": np.zeros((3, 2))}, {"x": np.zeros(1)}], lambda row: names[row])
    with pytest.raises(BadInput, match=r"gave 'points' of b.jpg as float64 \(3, 3\), but a.jpg as float64 \(3, 2\)"):
        pack("v", [{"points": np.zeros((3, 2))}, {"points": np.zeros((3, 3))}], lambda row: names[row])
    packed = pack("v", [{"p": np.arange(4).reshape(2, 2)}, {"p": np.zeros((0, 2), int)}], lambda row: names[row])
    assert packed.count == 2 and packed.item(1)["p"].shape == (0, 2)
    assert np.array_equal(packed.item(0)["p"], np.arange(4).reshape(2, 2))


def test_a_verifier_file_claiming_more_than_it_holds_is_refused_before_allocating(verified_index, tmp_path):
    import io
    import zipfile

    from numpy.lib import format as npy_format

    bomb = tmp_path / "bomb"
    shutil.copytree(verified_index, bomb)
    header = io.BytesIO()
    npy_format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**11, 2)})
    with zipfile.ZipFile(bomb / "verifier-geometric.npz", "w") as archive:  # 800 GB claimed, a few bytes held
        archive.writestr("points.npy", header.getvalue() + b"\0" * 16)
    _rewrite_checksum(bomb, "verifier-geometric.npz")
    with pytest.raises(IndexDirError, match=r"member 'points.npy': its header says shape \(100000000000, 2\)"):
        load_index_dir(bomb)

    deflated = tmp_path / "deflated"  # a compressed member could inflate without end: never read
    shutil.copytree(verified_index, deflated)
    with np.load(verified_index / "verifier-geometric.npz") as stored:
        contents = {key: stored[key] for key in stored.files}
    np.savez_compressed(deflated / "verifier-geometric.npz", **contents)
    _rewrite_checksum(deflated, "verifier-geometric.npz")
    with pytest.raises(IndexDirError, match="holds stored .npy members only"):
        load_index_dir(deflated)
