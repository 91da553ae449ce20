"""index --verify stores each verifier's per-capture data in the index dir (checksummed), and
search --verify re-ranks the embedding's shortlist by it: real FAISS index dirs, real captures."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from conftest import builtin_registry, run_cli, train_tiny
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
    assert set(meta) == META_KEYS - {"calibration"}  # calibration: written by `calibrate` (tested below)
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
    # itself and its 6 nearest others, by embedding and re-ranked
    plain = json.loads(cli("search", verified_index, query, "--k", "7", "--json").stdout)[0]["neighbours"]
    result = cli("search", verified_index, query, "--verify", "--shortlist", "6", "--k", "7", "--json")
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
    assert len(hits) == 7
    assert [h["row"] for h in json.loads(top.stdout)[0]["neighbours"]] == [h["row"] for h in hits[:2]]

    table = cli("search", verified_index, query, "--verify", "--shortlist", "6", "--k", "2", "--threshold", "0")
    best_other = next(h for h in hits if not h["same_file"])  # the verdict skips the query's own file
    assert "already indexed (row 4)" in table.stdout
    assert (
        f"DUPLICATE of receipt {best_other['receipt_id']} (verified score {best_other['verified']['score']:.3f}"
        in table.stdout
    )
    assert "verified " in table.stdout and "geometric " in table.stdout and "inliers " in table.stdout
    above = round(best_other["verified"]["score"] + 0.001, 3)  # just above the best other capture's score
    none = cli("search", verified_index, query, "--verify", "--shortlist", "6", "--k", "1", "--threshold", str(above))
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
    said = cli(
        "search",
        verified_index,
        "--all-pairs",
        "--threshold",
        "0.9",
        "--out",
        tmp_path / "p.csv",
        "--min-similarity",
        "0.5",
    )
    assert said.returncode == 2 and "--min-similarity goes with --all-pairs --verify" in said.stderr
    said = cli("search", verified_index, query, "--field", "date=1/2/2018")
    assert said.returncode == 2 and "--field goes with --verify" in said.stderr
    said = cli("search", verified_index, query, query, "--verify", "--field", "date=1/2/2018")
    assert said.returncode == 2 and "--field describes one query image; 2 were given" in said.stderr
    said = cli("search", verified_index, query, "--verify", "--field", "date")
    assert said.returncode == 2 and "--field date: give KEY=VALUE" in said.stderr
    said = cli("search", verified_index, query, "--threshold", "0.5", "--threshold", "0.6")
    assert said.returncode == 2 and "give --threshold once for image queries" in said.stderr
    said = cli("search", verified_index, query, "--verify", "--threshold", "-0.2")
    assert said.returncode == 2 and "--threshold -0.2 with --verify: verified scores are 0 to 1" in said.stderr
    said = cli("search", verified_index, "--all-pairs", "--out", tmp_path / "p.csv")
    assert said.returncode == 2 and "--all-pairs needs --threshold T: " in said.stderr
    assert "has no calibrated embedding threshold (`receipt-embed calibrate` stores one" in said.stderr
    said = cli("search", verified_index, "--all-pairs", "--threshold", "0.5")
    assert said.returncode == 2 and "--all-pairs writes its pairs to a CSV: give --out pairs.csv" in said.stderr
    said = cli("search", verified_index, query, "--verify", "--field", "date=")
    assert said.returncode == 2 and "--field date= has no value" in said.stderr
    base = ("index", "--checkpoint", checkpoint, "--data", dataset, "--out", tmp_path / "x")
    said = cli(*base, "--verify", "geometrc")
    assert said.returncode == 2 and "unknown verifier 'geometrc'" in said.stderr and "'geometric'" in said.stderr
    said = cli(*base, "--verify-set", "geometric.keypoints=900")
    assert said.returncode == 2 and "add --verify geometric" in said.stderr
    said = cli(*base, "--verify", "geometric", "--verify-set", "geometric.keypoint=900")
    assert said.returncode == 2 and (
        "its --verify-set may set long_side, keypoints, ratio, reprojection_px (did you mean 'keypoints' for "
        "'keypoint'?)" in said.stderr
    ), said.stderr
    said = cli(*base, "--verify", "fields", "--verify-set", "fields.fields=[shop]")
    assert said.returncode == 2 and "no capture has a usable value in shop, so it could only abstain" in said.stderr
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


def test_stored_data_unlike_what_the_verifier_extracts_is_named_before_any_score(cli, verified_index, tmp_path):
    """Checksums made to agree, contents a verifier cannot read: an error naming the file, what is
    wrong and how to rebuild, never a KeyError inside score."""
    query = load_index_dir(verified_index).items[0]["path"]
    for change, said in (
        (lambda c: c.update(pts=c.pop("points"), **{"pts@offsets": c.pop("points@offsets")}),
         r"it holds the arrays \['descriptors', 'pts', 'size'\], where extract gives \['descriptors', 'points', 'size'\]"),
        (lambda c: c.update(descriptors=c["descriptors"][:, :16].copy()), r"its descriptors are uint8 rows of shape \(16,\)"),
        (lambda c: c.update(points=c["points"].astype(np.float64)), "its points are float64 rows"),
    ):  # fmt: skip
        edited = tmp_path / f"edited{len(list(tmp_path.iterdir()))}"
        shutil.copytree(verified_index, edited)
        with np.load(edited / "verifier-geometric.npz") as stored:
            contents = {key: stored[key] for key in stored.files}
        change(contents)
        np.savez(edited / "verifier-geometric.npz", **contents)
        _rewrite_checksum(edited, "verifier-geometric.npz")
        result = cli("search", edited, query, "--verify")
        assert result.returncode == 2, result.stderr
        assert "verifier-geometric.npz is not what verifier 'geometric' (with the params index.json records) reads" in (
            result.stderr
        )
        assert re.search(said, result.stderr), result.stderr
        assert "rebuild it with `receipt-embed index ... --verify geometric --force`" in result.stderr


def test_fields_params_that_do_not_match_the_stored_values_are_refused(tmp_path):
    from receipt_embed.indexing.verifier_data import pack
    from receipt_embed.verification.fields import FieldsVerifier

    two = FieldsVerifier(fields=["date", "total"])
    stored = pack("fields", [two.extract(None, {"date": "1/2/2018", "total": "9"})] * 3, str)
    two.check_data(stored)  # what it extracted, it reads
    with pytest.raises(BadInput, match=r"it holds 2 values for some capture, but its params compare 3 text fields"):
        FieldsVerifier(fields=["date", "total", "merchant"]).check_data(stored)
    numbers = pack("fields", [{"values": np.zeros(2)}], str)
    with pytest.raises(BadInput, match="it holds float64 values"):
        two.check_data(numbers)


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


def test_the_pr_curve_and_the_chosen_threshold_match_a_brute_force_count():
    from receipt_embed.indexing.calibration import choose, pr_curve

    rng = np.random.default_rng(0)
    scores = np.round(rng.uniform(0, 1, 200), 2)  # rounded: many ties, which a threshold flags together
    right = rng.uniform(0, 1, 200) < scores  # higher scores are more often right
    positives = int(right.sum()) + 7  # some duplicates whose nearest capture is another receipt
    curve = pr_curve(scores, right, positives)
    assert [p["threshold"] for p in curve] == sorted(set(scores.tolist()), reverse=True)
    for point in curve:
        flagged = scores >= point["threshold"]
        assert point["flagged"] == flagged.sum()
        assert point["precision"] == pytest.approx(right[flagged].mean())
        assert point["recall"] == pytest.approx(right[flagged].sum() / positives)
    chosen = choose(curve, 0.9)
    assert chosen["precision"] >= 0.9
    assert all(p["recall"] <= chosen["recall"] for p in curve if p["precision"] >= 0.9)
    assert choose(curve, 1.01) is None


def test_calibrate_stores_thresholds_that_search_uses(cli, verified_index, tmp_path):
    from receipt_embed.indexing.calibration import best_neighbours, kind_checks

    index_dir = tmp_path / "calibrated"
    shutil.copytree(verified_index, index_dir)
    query = load_index_dir(index_dir).items[3]["path"]
    said = cli("search", index_dir, query, "--threshold", "auto")
    assert said.returncode == 2 and "has no calibration for it; run `receipt-embed calibrate" in said.stderr
    said = cli("calibrate", index_dir, "--target-precision", "0.9")
    assert said.returncode == 0, said.stderr
    assert "of duplicates caught" in said.stdout and "false alarms per 100 flagged" in said.stdout
    assert "embedding: " in said.stdout and "verified (geometric): " in said.stdout
    stored = load_index_dir(index_dir).meta["calibration"]
    uses = said.stdout.split("uses:\n", 1)[1]
    assert (
        f"search IMAGE (without --verify), and --all-pairs: the embedding threshold {stored['embedding']['threshold']:g}"
        in uses
    )
    if stored["verified"]["threshold"] is not None:
        assert "search IMAGE --verify, and --all-pairs --verify: the verified threshold" in uses
    index = load_index_dir(index_dir)  # checksums still hold: only index.json changed
    calibration = index.meta["calibration"]
    assert calibration["target_precision"] == 0.9 and calibration["queries"] == index.count
    receipts = np.array([item["receipt_id"] for item in index.items])
    assert calibration["embedding"]["threshold"] is not None  # the tiny model's neighbours reach 0.9
    for kind in ("embedding", "verified"):
        chosen = calibration[kind]
        registry = builtin_registry()
        scores, rows = best_neighbours(index, kind_checks(index, registry).get(kind), registry=registry)
        right = receipts[rows] == receipts
        if chosen["threshold"] is None:
            continue
        flagged = scores >= chosen["threshold"]
        assert right[flagged].mean() >= 0.9 and chosen["precision"] == pytest.approx(right[flagged].mean())
        assert chosen["recall"] == pytest.approx(right[flagged].sum() / calibration["duplicates_findable"])
    threshold = calibration["embedding"]["threshold"]
    plain = json.loads(cli("search", index_dir, query, "--json").stdout)[0]  # no --threshold: the calibrated one
    best_other = next(hit for hit in plain["neighbours"] if not hit["same_file"])
    assert plain["duplicate"] == (best_other["similarity"] >= threshold - 1e-6)
    assert plain["threshold_kind"] == "embedding"
    given = json.loads(cli("search", index_dir, query, "--json", "--threshold", "0.5").stdout)[0]
    assert given["threshold_kind"] == "given" and given["threshold"] == 0.5
    pairs = cli("search", index_dir, "--all-pairs", "--out", tmp_path / "p.csv")  # no --threshold: the calibrated one
    assert pairs.returncode == 0, pairs.stderr
    assert f"similarity >= {threshold:g}:" in pairs.stdout
    wrong = cli("search", index_dir, query, "--verify", "--verifier", "nosuch")  # the verifier named, not the threshold
    assert wrong.returncode == 2 and "holds no data for verifier 'nosuch'" in wrong.stderr
    table = cli("search", index_dir, query, "--threshold", "auto")
    said = f"{threshold:g}, the calibrated embedding threshold)"
    assert f">= {said}" in table.stdout or f"below {said}" in table.stdout


def test_a_calibration_is_not_written_onto_an_index_replaced_meanwhile(verified_index, tmp_path):
    from receipt_embed.indexing.index_dir import read_meta, write_calibration

    index_dir = tmp_path / "ix"
    shutil.copytree(verified_index, index_dir)
    before = (index_dir / "index.json").read_bytes()
    computed_on = {**read_meta(index_dir), "checksums": {"index.faiss": "0" * 64}}  # another index's
    with pytest.raises(IndexDirError, match="was replaced while it was being calibrated .* nothing was written"):
        write_calibration(index_dir, {"target_precision": 0.99}, calibrated=computed_on)
    assert (index_dir / "index.json").read_bytes() == before
    meta = write_calibration(index_dir, {"target_precision": 0.99}, calibrated=read_meta(index_dir))
    assert meta["calibration"] == {"target_precision": 0.99}
    # a second calibration of the same index replaces the first: calibration is not part of its identity
    write_calibration(index_dir, {"target_precision": 0.9}, calibrated=meta)
    assert read_meta(index_dir)["calibration"] == {"target_precision": 0.9}


def test_calibration_warns_where_its_thresholds_cannot_say_much():
    from receipt_embed.indexing.calibration import calibration_warnings, searches_using

    (low,) = calibration_warnings({"receipts": 40, "embedding": {"flagged": 500}}, 1e-300)
    assert low.startswith("--target-precision 1e-300 accepts more false alarms than duplicates")
    strict = calibration_warnings({"receipts": 40, "embedding": {"flagged": 500}}, 1.0)
    assert len(strict) == 1 and "--target-precision 1 picks the lowest threshold" in strict[0]
    assert calibration_warnings({"receipts": 40, "embedding": {"flagged": 500}}, 0.99) == []
    record = {"embedding": {"threshold": 0.9}, "verified": {"threshold": 0.5}, "verified_image": {"threshold": None}}
    assert searches_using(record) == [
        "search IMAGE (without --verify), and --all-pairs: the embedding threshold 0.9",
        "search IMAGE --verify --field KEY=VALUE, and --all-pairs --verify: the verified threshold 0.5",
    ]
    assert searches_using({"embedding": {"threshold": None}}) == []


def test_calibrate_refuses_an_index_of_one_receipt(tmp_path):
    from types import SimpleNamespace

    from receipt_embed.errors import BadInput
    from receipt_embed.indexing.calibration import calibrate

    index = SimpleNamespace(path=tmp_path, items=[{"receipt_id": "r1"}] * 4, count=4, meta={})
    with pytest.raises(BadInput, match="every capture is of one receipt, so no flag could be a false alarm"):
        calibrate(index)


def test_calibrate_refuses_an_index_it_cannot_calibrate(cli, tmp_path):
    rows = [{"path": f"img{i}.jpg", "receipt_id": f"r{i}", "device": "d"} for i in range(6)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(6, 8)).astype(np.float32))
    assert (
        cli(
            "index", "--embeddings", tmp_path / "x.npy", "--manifest", tmp_path / "m.jsonl", "--out", tmp_path / "ix"
        ).returncode
        == 0
    )
    said = cli("calibrate", tmp_path / "ix")
    assert said.returncode == 2 and "no receipt has two captures, so no duplicate can be found" in said.stderr
    said = cli("calibrate", tmp_path / "ix", "--target-precision", "0")
    assert said.returncode == 2 and "--target-precision" in said.stderr


def test_an_unreachable_target_is_said_in_words_and_auto_refuses_it(tmp_path):
    from types import SimpleNamespace

    from receipt_embed.indexing.calibration import calibrated_threshold, in_words

    entry = {"threshold": None, "curve": [{"threshold": 0.6875, "precision": 0.92, "recall": 0.13, "flagged": 25}]}
    assert (
        in_words("verified", entry, 0.99)
        == "verified: no threshold reaches 99.0% precision (the best is 92.0% at 0.6875)"
    )
    assert in_words("verified_image", {**entry, "verifiers": ["geometric"]}, 0.99).startswith(
        "verified_image (geometric: a search of an image without its fields): no threshold reaches"
    )
    chosen = {"threshold": 0.97511, "precision": 0.993, "recall": 0.817, "flagged": 148, "curve": []}
    assert in_words("embedding", chosen, 0.99) == (
        "embedding: at threshold 0.97511, 81.7% of duplicates caught, 0.7 false alarms per 100 flagged (148 flagged)"
    )
    index = SimpleNamespace(
        path=tmp_path, meta={"calibration": {"target_precision": 0.99, "embedding": chosen, "verified": entry}}
    )
    assert calibrated_threshold(index, "embedding") == 0.97511
    with pytest.raises(IndexDirError, match="no verified threshold of .* reached the target precision 0.99"):
        calibrated_threshold(index, "verified")


def test_a_verifier_without_evidence_is_left_out_of_the_verified_score():
    from receipt_embed.indexing.verification import verified_score

    assert verified_score([{"score": 0.8}, {"score": 0.5, "abstain": True}]) == 0.8
    assert verified_score([{"score": 0.8}, {"score": 0.0, "abstain": False}]) == 0.4
    assert verified_score([{"score": 0.5, "abstain": True}]) is None  # no evidence: no score at all


def test_a_veto_makes_the_verified_score_zero_whatever_the_others_say():
    from receipt_embed.indexing.verification import fused, verified_score

    assert verified_score([{"score": 0.9}, {"score": 0.0, "veto": True}]) == 0.0
    assert verified_score([{"score": 0.9}, {"score": 0.0, "veto": False}]) == 0.45
    assert verified_score([{"score": 0.9}, {"score": 0.5, "abstain": True, "veto": True}]) == 0.9  # no evidence
    rows = np.array([[1, 2, -1]])
    per = {
        "geometric": (np.array([[0.9, 0.8, 0.0]]), np.zeros((1, 3), bool), np.zeros((1, 3), bool)),
        "fields": (np.array([[0.0, 1.0, 0.0]]), np.zeros((1, 3), bool), np.array([[True, False, False]])),
    }
    assert fused(rows, per, ["geometric", "fields"]).tolist() == [[0.0, 0.9, -np.inf]]
    assert fused(rows, per, ["geometric"]).tolist() == [[0.9, 0.8, -np.inf]]  # a veto only counts when selected


def test_a_verifier_result_is_checked_before_it_is_used():
    from receipt_embed.errors import BadInput
    from receipt_embed.indexing.verification import score_figures

    assert score_figures("v", {"score": np.int64(1)})["score"] == 1.0
    assert score_figures("v", {"score": np.float32(0.25), "abstain": np.bool_(False)}) == {
        "score": 0.25,
        "abstain": False,
    }
    for bad, said in (
        ({"score": 10**400}, "returned a score of 1000000"),
        ({"score": float("nan")}, "returned a score of nan"),
        ({"score": True}, "returned a score of True"),
        ({"score": 1.5}, "must be a number in [0, 1]"),
        ({"score": 0.5, "abstain": "yes"}, "returned abstain='yes': it must be true or false"),
        ({"score": 0.5, "abstain": 1}, "returned abstain=1"),
        ({"score": 0.0, "veto": "no"}, "returned veto='no': it must be true or false"),
    ):
        with pytest.raises(BadInput, match=re.escape(said)):
            score_figures("v", bad)
    with pytest.raises(BadInput, match=r"returned a score of 1{57}\.\.\."):
        score_figures("v", {"score": int("1" * 500)})


def test_pairs_on_which_every_verifier_abstained_are_never_flagged():
    from receipt_embed.indexing.calibration import pr_curve
    from receipt_embed.indexing.verification import fused

    rows = np.array([[1, 2], [0, -1], [0, 1]])
    per = {
        "fields": (
            np.array([[1.0, 0.5], [0.5, 0.0], [0.0, 0.5]]),
            np.array([[False, True], [True, True], [False, True]]),
            np.zeros((3, 2), bool),
        )
    }
    verified = fused(rows, per, ["fields"])
    assert verified.tolist() == [[1.0, -np.inf], [-np.inf, -np.inf], [0.0, -np.inf]]
    curve = pr_curve(np.array([1.0, -np.inf, 0.0]), np.array([True, True, False]), positives=3)
    assert [(p["threshold"], p["flagged"]) for p in curve] == [(1.0, 1), (0.0, 2)]  # the -inf query never flags
    assert curve[-1]["recall"] == pytest.approx(1 / 3)


def test_a_threshold_on_too_few_flags_is_warned_about():
    from receipt_embed.indexing.calibration import few_flags

    record = {"embedding": {"flagged": 22}, "verified": {"flagged": 1698}, "verified_image": {"flagged": None}}
    assert few_flags(record, 0.99) == [
        "the embedding threshold rests on 22 flagged queries; 100 are needed before precision 0.99 can show one "
        "false alarm in 100: calibrate on more labelled captures"
    ]
    assert few_flags({"embedding": {"flagged": 10}}, 0.9) == []
    assert len(few_flags({"embedding": {"flagged": 9}}, 0.9)) == 1
    assert few_flags({"embedding": {"flagged": 1}}, 1.0) == []
    (one,) = few_flags({"verified_image": {"flagged": 1, "recall": 0.006}}, 0.99)
    assert one.startswith("the verified_image threshold rests on 1 flagged query; 100 are needed")
    assert one.endswith(
        "or accept that this score reaches 0.99 only at a recall of 0.6% (a lower --target-precision; for "
        "verified_image, searches given the query's --field values)"
    )


def test_a_calibration_with_values_out_of_their_range_is_named_on_load(verified_index, tmp_path):
    good = {"threshold": 0.5, "precision": 1.0, "recall": 0.9, "flagged": 10, "verifiers": ["geometric"], "curve": []}
    point = {"threshold": 0.5, "precision": 1.0, "recall": 0.9, "flagged": 10}
    for kind, change, said in (
        ("embedding", {"threshold": -1.5}, "calibration.embedding.threshold is a float (-1.5), expected a cosine similarity: a number in [-1, 1]"),
        ("verified", {"threshold": -0.2}, "expected a verified score: a number in [0, 1], or null"),
        ("verified_image", {"threshold": float("inf")}, "calibration.verified_image.threshold is a float (inf)"),
        ("verified", {"precision": 1.2}, "calibration.verified.precision is a float (1.2), expected a number in [0, 1]"),
        ("verified", {"recall": "all"}, "calibration.verified.recall is a str"),
        ("verified", {"flagged": 2.5}, "calibration.verified.flagged is a float (2.5), expected an integer >= 0"),
        ("verified", {"verifiers": "geometric"}, "calibration.verified.verifiers is a str ('geometric'), expected a list"),
        ("verified", {"verifiers": [1]}, "expected a list of verifier names"),
        ("verified", {"curve": {}}, "calibration.verified.curve is a dict"),
        ("verified", {"curve": [{**point, "recall": None}]}, "expected points of numbers {threshold, precision, recall}"),
        ("verified", {"curve": [{**point, "precision": 3}]}, "expected points of numbers"),
    ):  # fmt: skip
        edited = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(verified_index, edited)
        meta = json.loads((edited / "index.json").read_text())
        meta["calibration"] = {"target_precision": 0.99, kind: {**good, **change}}
        (edited / "index.json").write_text(json.dumps(meta))
        with pytest.raises(IndexDirError) as raised:
            load_index_dir(edited)
        assert said in str(raised.value), (change, str(raised.value))
    meta["calibration"] = {"target_precision": 0.99, "verified": {**good, "curve": [point]}}
    (edited / "index.json").write_text(json.dumps(meta))
    assert load_index_dir(edited).meta["calibration"]["verified"]["threshold"] == 0.5  # what calibrate writes loads


@pytest.mark.parametrize(
    "given, said",
    [
        ("0.9,0.95", "'0.9,0.95' is several numbers: give each its own option (--threshold 0.9 --threshold 0.95)"),
        ("abc", "'abc' is not a number in [-1, 1] or auto"),
        ("nan", "nan is not a number; give a finite value"),
        ("1.5", "1.5 is not in the range -1<=x<=1"),
    ],
)
def test_a_threshold_that_is_not_one_number_says_what_to_give(given, said):
    import click

    from receipt_embed.cli.search import ThresholdType

    with pytest.raises(click.BadParameter, match=re.escape(said)):
        ThresholdType().convert(given, None, None)
    assert ThresholdType().convert(" Auto ", None, None) == "auto"
    assert ThresholdType().convert("-0.25", None, None) == -0.25


def test_a_malformed_calibration_says_how_to_replace_it_and_calibrate_does(cli, verified_index, tmp_path):
    index_dir = tmp_path / "edited"
    shutil.copytree(verified_index, index_dir)
    meta = json.loads((index_dir / "index.json").read_text())
    meta["calibration"] = {"verified": {"threshold": 1.5}}
    (index_dir / "index.json").write_text(json.dumps(meta))
    with pytest.raises(IndexDirError, match=re.escape(f"run `receipt-embed calibrate {index_dir}` to replace")):
        load_index_dir(index_dir)
    said = cli("calibrate", index_dir, "--target-precision", "0.9")
    assert said.returncode == 0, said.stderr
    assert load_index_dir(index_dir).meta["calibration"]["target_precision"] == 0.9
