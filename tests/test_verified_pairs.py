"""search --all-pairs: several thresholds read against every same-receipt pair of the index, the
manifest's own columns kept, and (--verify) each candidate pair scored by the stored verifier data
of both captures; search --field gives a query image its printed fields. Real FAISS index dirs."""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, builtin_registry, run_cli, train_tiny

from receipt_embed.errors import BadInput
from receipt_embed.indexing import load_index_dir
from receipt_embed.indexing.pairs import (
    PAIR_COLUMNS,
    manifest_columns,
    pair_columns,
    same_receipt_pairs,
    shortlist_pairs,
    summarise,
)


def _clustered(n=240, dim=16, receipts=60, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(receipts, dim))
    labels = np.arange(n) % receipts
    x = centres[labels] + 0.45 * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32), labels


def test_shortlist_pairs_are_each_items_nearest_others_once():
    x, _ = _clustered()
    a, b, sims = shortlist_pairs(x, 4)
    gram = x.astype(np.float64) @ x.T
    np.fill_diagonal(gram, -np.inf)
    nearest = np.argsort(-gram, axis=1, kind="stable")[:, :4]
    expected = {(min(i, j), max(i, j)) for i in range(len(x)) for j in nearest[i].tolist()}
    assert set(zip(a.tolist(), b.tolist())) == expected and len(a) == len(expected)
    assert np.all(a < b)
    np.testing.assert_allclose(sims, gram[a, b], atol=1e-5)
    assert np.all(np.diff(sims) <= 0)
    a2, b2, sims2 = shortlist_pairs(x, 4, min_similarity=0.6)
    keep = sims >= 0.6 - 1e-6
    assert set(zip(a2.tolist(), b2.tolist())) == set(zip(a[keep].tolist(), b[keep].tolist()))


def test_same_receipt_pairs_and_the_summary_count_what_a_reviewer_reads():
    items = [{"receipt_id": r} for r in ["a", "a", "a", "b", "b", "c"]]
    assert same_receipt_pairs(items) == 3 + 1  # C(3, 2) + C(2, 2)
    assert same_receipt_pairs([*items, {"receipt_id": ""}]) is None
    scores = np.array([0.9, 0.8, 0.8, 0.4, 0.2])
    same = np.array([1, 1, 0, 1, -1], dtype=np.int8)
    rows = summarise(scores, same, [0.8, 0.3, 1.0], duplicates=4)
    assert [row["threshold"] for row in rows] == [0.3, 0.8, 1.0]
    assert rows[0] == {
        "threshold": 0.3,
        "pairs": 4,
        "same_receipt": 3,
        "different_receipts": 1,
        "unlabelled": 0,
        "precision": 0.75,
        "recall": 0.75,
    }
    assert rows[1]["pairs"] == 3 and rows[1]["precision"] == pytest.approx(2 / 3) and rows[1]["recall"] == 0.5
    assert rows[2]["pairs"] == 0 and rows[2]["precision"] is None and rows[2]["recall"] == 0.0


def test_the_manifest_columns_follow_the_pair_columns_without_clashing():
    items = [
        {"path": "p", "receipt_id": "r", "device": "d", "sha256": "x", "split": "train", "total": "9", "row": "1"},
        {"path": "q", "receipt_id": "r", "device": "d", "date": "1/2/18"},
    ]
    assert manifest_columns(items) == ["total", "row", "date"]
    header = pair_columns(["geometric"], manifest_columns(items))
    assert header[: len(PAIR_COLUMNS)] == list(PAIR_COLUMNS)
    assert header[len(PAIR_COLUMNS) :] == [
        "verified",
        "geometric_score",
        "total_a",
        "total_b",
        "manifest.row_a",  # row_a is the pair's own column
        "manifest.row_b",
        "date_a",
        "date_b",
    ]
    assert len(set(header)) == len(header)
    clashing = pair_columns([], ["row", "manifest.row"])  # a manifest whose own column is manifest.row
    assert clashing[len(PAIR_COLUMNS) :] == [
        "manifest.row_a",
        "manifest.row_b",
        "manifest.manifest.row_a",
        "manifest.manifest.row_b",
    ]


def test_all_pairs_reports_each_threshold_against_every_same_receipt_pair(cli, tmp_path):
    x, labels = _clustered()
    np.save(tmp_path / "x.npy", x)
    with open(tmp_path / "m.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "receipt_id", "device", "total"])
        writer.writerows([[f"img{i}.jpg", f"r{label}", f"d{i % 4}", f"{label}.50"] for i, label in enumerate(labels)])
    built = cli("index", "--embeddings", tmp_path / "x.npy", "--manifest", tmp_path / "m.csv", "--out", tmp_path / "ix")
    assert built.returncode == 0, built.stderr
    out = tmp_path / "pairs.csv"
    said = cli("search", tmp_path / "ix", "--all-pairs", "--threshold", "0.8", "--threshold", "0.6", "--out", out)
    assert said.returncode == 0, said.stderr
    gram = x.astype(np.float64) @ x.T
    i, j = np.triu_indices(len(x), k=1)
    duplicates = int(np.sum(labels[i] == labels[j]))  # 60 receipts x C(4, 2)
    assert duplicates == 360 and f"240 items, {duplicates} same-receipt pairs among them" in said.stdout
    for threshold in (0.6, 0.8):
        keep = gram[i, j] >= threshold
        right = int(np.sum(keep & (labels[i] == labels[j])))
        line = (
            f"similarity >= {threshold:g}: {int(keep.sum())} pairs, {right} same receipt, "
            f"{int(keep.sum()) - right} different receipts; precision {right / keep.sum():.1%}, "
            f"recall {right / duplicates:.1%} of the same-receipt pairs"
        )
        assert line in said.stdout, said.stdout
    rows = list(csv.DictReader(open(out)))
    assert len(rows) == int(np.sum(gram[i, j] >= 0.6))  # the lowest threshold's pairs
    first = rows[0]
    assert (
        first["total_a"] == f"{labels[int(first['row_a'])]}.50"
        and first["total_b"] == f"{labels[int(first['row_b'])]}.50"
    )
    summary = json.loads(
        cli("search", tmp_path / "ix", "--all-pairs", "--threshold", "0.6", "--out", out, "--force", "--json").stdout
    )
    assert summary["same_receipt_pairs"] == duplicates and summary["score"] == "similarity"
    assert summary["thresholds"][0]["pairs"] == len(rows)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("pairs"))


@pytest.fixture(scope="module")
def both_index(trained, tmp_path_factory):
    """data_samples' held-out captures with geometric and fields (its manifest's merchant column)."""
    dataset, checkpoint = trained
    out = tmp_path_factory.mktemp("pix") / "heldout"
    result = run_cli(
        "index", "--checkpoint", checkpoint, "--data", dataset, "--split", "heldout", "--out", out,
        "--verify", "geometric", "--verify-set", "geometric.keypoints=800", "--verify", "fields",
        "--verify-set", "fields.fields=[merchant]", "-q",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return out


def test_all_pairs_verify_scores_each_candidate_with_both_captures_data(cli, both_index, tmp_path):
    from receipt_embed.indexing.verification import verified_score
    from receipt_embed.verification.fields import FieldsVerifier
    from receipt_embed.verification.geometric import GeometricVerifier

    out = tmp_path / "verified.csv"
    said = cli(
        "search", both_index, "--all-pairs", "--verify", "--shortlist", "3", "--threshold", "0",
        "--threshold", "0.6", "--out", out,
    )  # fmt: skip
    assert said.returncode == 0, said.stderr
    index = load_index_dir(both_index)
    a, b, sims = shortlist_pairs(index.embeddings, 3)
    rows = list(csv.DictReader(open(out)))
    assert len(rows) == len(a)  # threshold 0: every candidate is kept
    assert f"verified {len(a)} candidate pairs (each item's 3 nearest) with geometric, fields" in said.stdout
    geometric, fields = GeometricVerifier(keypoints=800), FieldsVerifier(fields=["merchant"])
    stored = index.verifiers
    for row in rows[:12]:
        i, j = int(row["row_a"]), int(row["row_b"])
        g = geometric.score(stored["geometric"].item(i), stored["geometric"].item(j))
        f = fields.score(stored["fields"].item(i), stored["fields"].item(j))
        assert float(row["geometric_score"]) == pytest.approx(g["score"], abs=1e-6)
        assert float(row["fields_score"]) == pytest.approx(f["score"], abs=1e-6)
        assert float(row["verified"]) == pytest.approx(verified_score([g, f]), abs=1e-6)
        assert row["merchant_a"] == index.items[i]["merchant"] and row["merchant_b"] == index.items[j]["merchant"]
    scores = [float(row["verified"]) for row in rows]
    assert scores == sorted(scores, reverse=True)  # best verified first
    kept = sum(s >= 0.6 - 1e-6 for s in scores)
    assert f"verified >= 0.6: {kept} pairs" in said.stdout


def test_a_query_with_its_fields_is_judged_on_every_verifier(cli, both_index, tmp_path):
    """--field gives the query image the row a fields verifier reads; without it, fields abstain."""
    index = load_index_dir(both_index)
    item = index.items[0]
    common = ("search", both_index, item["path"], "--verify", "--json", "-k", "3")
    bare = json.loads(cli(*common).stdout)[0]
    assert all(hit["verified"]["fields"]["abstain"] for hit in bare["neighbours"])
    own = json.loads(cli(*common, "--field", f"merchant={item['merchant'].lower()}").stdout)[0]
    for hit in own["neighbours"]:
        agrees = index.items[hit["row"]]["merchant"] == item["merchant"]
        assert hit["verified"]["fields"]["score"] == (1.0 if agrees else 0.0)
        assert hit["verified"]["fields"]["veto"] is not agrees
        # agreeing: the mean of both; a differing shop vetoes the pair, whatever the geometry says
        expected = (hit["verified"]["geometric"]["score"] + 1.0) / 2 if agrees else 0.0
        assert hit["verified"]["score"] == pytest.approx(expected, abs=1e-6)
    other = json.loads(cli(*common, "--field", "merchant=NO SUCH SHOP").stdout)[0]
    assert all(hit["verified"]["fields"]["score"] == 0.0 for hit in other["neighbours"])
    assert all(hit["verified"]["score"] == 0.0 for hit in other["neighbours"])
    table = cli("search", both_index, item["path"], "--verify", "-k", "1", "--field", "merchant=NO SUCH SHOP").stdout
    assert "fields 0.000, vetoes the pair (agree [], differ [merchant]" in table


def test_calibration_keeps_the_image_alone_apart_and_search_picks_the_one_it_is(cli, both_index, tmp_path):
    from receipt_embed.indexing.calibration import search_kind

    index_dir = tmp_path / "calibrated"
    shutil.copytree(both_index, index_dir)
    said = cli("calibrate", index_dir, "--target-precision", "0.5")
    assert said.returncode == 0, said.stderr
    assert "verified (geometric, fields): " in said.stdout
    assert "verified_image (geometric: a search of an image without its fields): " in said.stdout
    calibration = load_index_dir(index_dir).meta["calibration"]
    assert calibration["verified"]["verifiers"] == ["geometric", "fields"]
    assert calibration["verified_image"]["verifiers"] == ["geometric"]
    assert search_kind(False, True, calibration) == "embedding"
    assert search_kind(True, False, calibration) == "verified_image"
    assert search_kind(True, True, calibration) == "verified"
    assert search_kind(True, False, {"verified": {}}) == "verified"  # an index of image verifiers only
    item = load_index_dir(index_dir).items[0]
    common = ("search", index_dir, item["path"], "--verify", "--json")
    for extra, kind in (((), "verified_image"), (("--field", f"merchant={item['merchant']}"), "verified")):
        result = json.loads(cli(*common, *extra).stdout)[0]
        expected = calibration[kind]["threshold"]
        assert expected is not None  # precision 0.5 is reached on these captures
        assert result["threshold"] == expected and result["score"] == "verified"
    pairs = cli("search", index_dir, "--all-pairs", "--verify", "--threshold", "auto", "--out", tmp_path / "p.csv")
    assert pairs.returncode == 0, pairs.stderr
    assert f"verified >= {calibration['verified']['threshold']:g}:" in pairs.stdout
    plain = json.loads(cli("search", index_dir, item["path"], "--json").stdout)[0]
    assert plain["score"] == "similarity" and plain["threshold"] == calibration["embedding"]["threshold"]


def test_builtin_registry_builds_what_the_index_records(both_index):
    """The verifiers of a --verify all-pairs run are built from index.json's params, as for a search."""
    from receipt_embed.indexing.verification import verifiers_of

    checks = verifiers_of(load_index_dir(both_index), [], builtin_registry())
    assert list(checks) == ["geometric", "fields"]
    assert checks["geometric"][0].keypoints == 800 and checks["fields"][0].fields == ["merchant"]


def _reference_verified_ranking(index, shortlist: int, only: tuple[str, ...] = ("geometric", "fields")):
    """Each query's ranking by an independent route: a brute-force embedding order, its first
    ``shortlist`` re-scored by freshly built verifiers (``only`` these) on the stored data and
    sorted (stable)."""
    from receipt_embed.indexing.verification import verified_score
    from receipt_embed.verification.fields import FieldsVerifier
    from receipt_embed.verification.geometric import GeometricVerifier

    x = index.embeddings.astype(np.float64)
    gram = x @ x.T
    verifiers = {"geometric": GeometricVerifier(keypoints=800), "fields": FieldsVerifier(fields=["merchant"])}
    verifiers = {name: verifier for name, verifier in verifiers.items() if name in only}
    rankings = []
    for q in range(len(x)):
        order = [int(j) for j in np.argsort(-gram[q], kind="stable") if j != q]
        head = order[:shortlist]
        scores = [
            verified_score(
                [v.score(index.verifiers[n].item(q), index.verifiers[n].item(j)) for n, v in verifiers.items()]
            )
            for j in head
        ]
        reranked = [head[i] for i in sorted(range(len(head)), key=lambda i: -scores[i])]
        rankings.append(reranked + order[shortlist:])
    return rankings


def test_audit_verify_gives_the_retrieval_figures_on_the_verified_ranking(cli, both_index, tmp_path):
    report = tmp_path / "report"
    said = cli("audit-shortcuts", both_index, "--verify", "--shortlist", "4", "--out", report, "-q")
    assert said.returncode == 0, said.stderr
    figures = json.loads((report / "audit.json").read_text())
    verified = figures["retrieval"]["verified"]
    assert set(figures["retrieval"]) - {"verified"} <= set(verified)  # the same keys, beside the embedding's
    image = verified["image"]  # and with the image's verifiers alone, as a bare query image is judged
    assert image["verifiers"] == ["geometric"] and set(figures["retrieval"]) - {"verified"} <= set(image)
    assert verified["shortlist"] == 4 and verified["verifiers"] == ["geometric", "fields"]
    index = load_index_dir(both_index)
    labels = np.array([item["receipt_id"] for item in index.items])
    devices = np.array([item["device"] for item in index.items])
    rankings = _reference_verified_ranking(index, 4)
    queries = [q for q in range(len(labels)) if np.sum(labels == labels[q]) > 1]
    for k in (1, 5, 10):
        expected = np.mean([np.any(labels[rankings[q][:k]] == labels[q]) for q in queries])
        assert verified[f"recall_at_{k}"] == pytest.approx(expected), k
    aps = []
    for q in queries:
        hits = labels[rankings[q]] == labels[q]
        ranks = np.flatnonzero(hits) + 1
        aps.append(np.mean(np.arange(1, len(ranks) + 1) / ranks))
    assert verified["map"] == pytest.approx(np.mean(aps), abs=1e-9)
    cross = []
    for q in queries:
        first = next(j for j in rankings[q] if not (labels[j] == labels[q] and devices[j] == devices[q]))
        cross.append(labels[first] == labels[q])
    assert verified["cross_attribute"]["device"]["recall_at_1"] == pytest.approx(np.mean(cross))
    curves = figures["precision_recall"]["curves"]
    assert set(curves) == {"embedding", "verified", "verified_image"}  # the image's verifiers alone too
    for kind, ranked in (
        ("verified", rankings),
        ("verified_image", _reference_verified_ranking(index, 4, ("geometric",))),
    ):
        right = labels[[ranked[q][0] for q in range(len(labels))]] == labels
        assert curves[kind][-1]["recall"] == pytest.approx(right.sum() / len(queries)), kind  # every query flagged
    alone = _reference_verified_ranking(index, 4, ("geometric",))
    assert image["recall_at_1"] == pytest.approx(np.mean([labels[alone[q][0]] == labels[q] for q in queries]))
    assert f"verified (geometric, fields, shortlist 4): recall@1 {verified['recall_at_1']:.3f}" in said.stdout
    html = (report / "audit.html").read_text()
    assert "verified (geometric, fields, shortlist 4)" in html and 'alt="precision against recall"' in html


def test_the_verified_report_renders_in_a_headless_browser(cli, both_index, tmp_path):
    """Both columns of the retrieval table and the precision-recall plot, as Chromium shows them."""
    from conftest import browser_page

    report = tmp_path / "report"
    assert cli("audit-shortcuts", both_index, "--verify", "--out", report, "-q").returncode == 0
    page = browser_page(report / "audit.html")
    figures = json.loads((report / "audit.json").read_text())["retrieval"]
    table = {row[0]: row[1:] for row in page["retrieval"]}
    assert table["figure"] == [
        "embedding",
        "verified (geometric, fields, shortlist 10)",
        "verified (geometric, shortlist 10): a bare image",
    ]
    verified = figures["verified"]
    shown = [figures["recall_at_1"], verified["recall_at_1"], verified["image"]["recall_at_1"]]
    assert table["recall@1"] == [f"{value:.3f}" for value in shown]
    plot = next(image for image in page["images"] if image["alt"] == "precision against recall")
    assert plot["complete"] and plot["width"] > 100


def test_audit_verify_needs_verifier_data_and_shortlist_needs_verify(cli, trained, tmp_path):
    dataset, checkpoint = trained
    plain = tmp_path / "plain"
    assert cli("index", "--checkpoint", checkpoint, "--data", dataset, "--out", plain, "-q").returncode == 0
    said = cli("audit-shortcuts", plain, "--verify", "--out", tmp_path / "r")
    assert said.returncode == 2 and "holds no verifier data: build it with `receipt-embed index" in said.stderr
    assert "verifying each item" not in said.stdout + said.stderr  # refused before any work is announced
    assert not (tmp_path / "r").exists()
    said = cli("audit-shortcuts", plain, "--shortlist", "5", "--out", tmp_path / "r")
    assert said.returncode == 2 and "--shortlist goes with --verify" in said.stderr


def test_a_search_on_which_every_verifier_abstains_gives_no_verdict(cli, both_index):
    """The fields verifier alone, and a query without its fields: no evidence, so no verdict (not a
    0.5 judged against the threshold), and the table says the verifier abstained."""
    item = load_index_dir(both_index).items[0]
    common = ("search", both_index, item["path"], "--verify", "--verifier", "fields", "--threshold", "0.4")
    result = json.loads(cli(*common, "--json").stdout)[0]
    assert result["duplicate"] is None and result["match"] is None
    assert all(hit["verified"]["score"] is None for hit in result["neighbours"])
    assert all(hit["verified"]["fields"]["score"] is None for hit in result["neighbours"])  # no 0.5 placeholder
    table = cli(*common)
    assert table.returncode == 0, table.stderr
    assert "no verdict: every verifier abstained on every other capture" in table.stdout
    assert "fields abstained (nothing to compare)" in table.stdout and "0.500" not in table.stdout
    assert "give --field KEY=VALUE" in table.stdout
    assert f"verified   -    similarity {result['neighbours'][0]['similarity']:.3f}" in table.stdout
    given = json.loads(cli(*common, "--json", "--field", f"merchant={item['merchant']}").stdout)[0]
    assert given["duplicate"] is True  # a capture of the same shop agrees, so the verdict returns


def test_a_field_no_selected_verifier_compares_is_refused(cli, both_index):
    item = load_index_dir(both_index).items[0]
    common = ("search", both_index, item["path"], "--verify")
    alone = cli(*common, "--verifier", "geometric", "--field", "merchant=x")
    assert alone.returncode == 2
    assert "--field merchant: no selected verifier compares printed fields (this search uses geometric" in alone.stderr
    unread = cli(*common, "--field", "date=25/12/2018", "--field", "merchant=x")
    assert unread.returncode == 2
    assert "--field date: no selected verifier compares it (fields compares merchant)" in unread.stderr


def test_one_field_alone_is_noted_where_the_verifier_compares_more():
    from receipt_embed.indexing.verification import check_query_fields
    from receipt_embed.verification.fields import FieldsVerifier

    checks = {"fields": (FieldsVerifier(fields=["date", "total", "merchant"]), None)}
    (note,) = check_query_fields(checks, {"date": "25/12/2018"})
    assert note == (
        "--field date alone: each pair is judged on that one field, and an agreeing date scores as high as all "
        "fields agreeing, though other receipts can share it; give total, merchant too where you have them"
    )
    assert check_query_fields(checks, {"date": "25/12/2018", "total": "9"}) == []
    assert check_query_fields({"fields": (FieldsVerifier(fields=["merchant"]), None)}, {"merchant": "x"}) == []
    assert check_query_fields(checks, None) == []


def test_all_pairs_leaves_pairs_without_evidence_unscored_and_unflagged(tmp_path):
    """verify_pairs with the real fields verifier: a pair sharing no field has no verified score
    (NaN, a blank CSV cell), so no threshold flags it."""
    from types import SimpleNamespace

    from receipt_embed.indexing.pairs import pair_rows, verify_pairs
    from receipt_embed.verification.fields import FieldsVerifier

    verifier = FieldsVerifier(fields=["date", "total"])
    rows = [{"date": "25/12/2018", "total": "9.00"}, {"date": "25-12-18"}, {}, {"total": "7"}]
    extracted = [verifier.extract(None, row) for row in rows]
    data = SimpleNamespace(item=lambda i: extracted[i])
    a, b = np.array([0, 0, 1, 2]), np.array([1, 2, 3, 3])
    scores = verify_pairs({"fields": (verifier, data)}, builtin_registry(), a, b)
    assert scores["score"][0] == 1.0  # 0 and 1 agree on the date; the others share no field
    assert np.isnan(scores["score"][[1, 2, 3]]).all() and np.isnan(scores["fields"][[1, 2, 3]]).all()
    items = [{"receipt_id": "r", "device": "d", "path": f"p{i}"} for i in range(4)]
    written = list(pair_rows(SimpleNamespace(items=items), a, b, np.ones(4, dtype=np.float32), scores))
    assert [row[len(PAIR_COLUMNS)] for row in written] == ["1.000000", "", "", ""]
    assert summarise(scores["score"], np.ones(4, dtype=np.int8), [0.0], 6)[0]["pairs"] == 1


def _geometric_checks(paths):
    """The real geometric verifier's data of ``paths``, as an index stores it."""
    from receipt_embed.images import DEFAULT_MAX_PIXELS, decode_image
    from receipt_embed.indexing.verifier_data import pack
    from receipt_embed.verification.geometric import GeometricVerifier

    verifier = GeometricVerifier(keypoints=400)
    images = [np.asarray(decode_image(Path(p).read_bytes(), DEFAULT_MAX_PIXELS, name=str(p)).image) for p in paths]
    return verifier, pack("geometric", [verifier.extract(image) for image in images], lambda row: paths[row])


def test_a_bare_image_is_judged_on_the_image_verifiers_alone():
    """A verifier of manifest rows has nothing of a bare query image: it abstains without being
    asked, so the verified score is the image verifiers' (what verified_image was calibrated on)."""
    from types import SimpleNamespace

    from receipt_embed.indexing.verification import check_pairs
    from receipt_embed.userfiles import DEFAULT_MAX_BYTES
    from receipt_embed.verification.fields import FieldsVerifier

    class Eager(FieldsVerifier):  # a verifier of rows that never abstains, even on an empty row
        def score(self, query, candidate):
            return {"score": 1.0}

    images = REPO / "data_samples" / "images"
    paths = [str(images / "r0000_phone_a.jpg"), str(images / "r0000_phone_b.jpg")]
    geometric, data = _geometric_checks(paths)
    rows = Eager(fields=["merchant"])
    row_data = SimpleNamespace(item=lambda row: rows.extract(None, {"merchant": "Shop"}))
    checks = {"geometric": (geometric, data), "fields": (rows, row_data)}
    hit = {"row": 1, "path": paths[1], "similarity": 0.9, "same_file": False}
    limits = (10_000_000, DEFAULT_MAX_BYTES)
    (bare,) = check_pairs(checks, builtin_registry(), paths[0], [hit], limits)
    assert bare["verified"]["fields"] == {"score": None, "abstain": True}
    assert bare["verified"]["score"] == bare["verified"]["geometric"]["score"] > 0
    (no_fields,) = check_pairs(checks, builtin_registry(), paths[0], [hit], limits, {})  # search without --field
    assert no_fields["verified"] == bare["verified"]
    (given,) = check_pairs(checks, builtin_registry(), paths[0], [hit], limits, {"merchant": "Shop"})
    assert given["verified"]["score"] == pytest.approx((given["verified"]["geometric"]["score"] + 1.0) / 2, abs=1e-6)


def test_an_auto_threshold_judges_only_the_verifiers_it_was_calibrated_on(tmp_path):
    from types import SimpleNamespace

    from receipt_embed.indexing import IndexDirError
    from receipt_embed.indexing.calibration import calibrated_threshold

    calibration = {
        "verified": {"threshold": 0.5, "verifiers": ["geometric", "fields"]},
        "verified_image": {"threshold": 0.9, "verifiers": ["geometric"]},
    }
    index = SimpleNamespace(
        path=tmp_path, meta={"calibration": calibration, "verifiers": {"geometric": {}, "fields": {}, "odd": {}}}
    )
    assert calibrated_threshold(index, "verified", ["geometric", "fields"]) == 0.5
    assert calibrated_threshold(index, "verified_image", ["geometric", "fields"]) == 0.9  # fields abstain on it
    with pytest.raises(IndexDirError, match="calibrated with geometric, fields, and this search adds odd, so its"):
        calibrated_threshold(index, "verified", ["geometric", "fields", "odd"])
    with pytest.raises(IndexDirError, match="calibrated with geometric, and this search adds odd"):
        calibrated_threshold(index, "verified_image", ["geometric", "odd"])
    with pytest.raises(IndexDirError, match="this search leaves out fields"):
        calibrated_threshold(index, "verified", ["geometric"])


def test_a_query_field_the_verifier_cannot_read_is_refused():
    from receipt_embed.errors import BadInput
    from receipt_embed.indexing.verification import check_query_fields
    from receipt_embed.verification.fields import FieldsVerifier

    checks = {"fields": (FieldsVerifier(fields=["date", "total"]), None)}
    for key, value in (("total", "NaN"), ("date", "99/99/9999")):
        with pytest.raises(
            BadInput, match=re.escape(f"--field {key}={value}: verifier fields does not read it as a {key}")
        ):
            check_query_fields(checks, {"date": "25/12/2018", "total": "9", key: value})


def test_a_check_data_that_crashes_is_the_plugins_failure_not_the_files(tmp_path):
    from types import SimpleNamespace

    from receipt_embed.indexing import IndexDirError
    from receipt_embed.indexing.verification import verifiers_of
    from receipt_embed.registry import ComponentError, Registry

    class Checked:
        def __init__(self, mode):
            self.mode = mode

        def extract(self, image, item=None):
            return {}

        def score(self, query, candidate):
            return {"score": 0.5}

        def check_data(self, data):
            if self.mode == "crash":
                raise RuntimeError("boom")
            raise BadInput("holds 3 values a capture, where 2 are read")

    registry = Registry()
    registry.add("verifier", "thirdparty", "checked", Checked)
    for mode, error, said in (
        ("crash", ComponentError, "verifier 'checked' (from plugin 'thirdparty') failed while checking verifier-checked.npz: RuntimeError: boom"),
        ("refuse", IndexDirError, "verifier-checked.npz is not what verifier 'checked' (with the params index.json records) reads: holds 3"),
    ):  # fmt: skip
        index = SimpleNamespace(
            path=tmp_path,
            meta={"verifiers": {"checked": {"params": {"mode": mode}, "file": "verifier-checked.npz"}}},
            verifiers={"checked": None},
        )
        with pytest.raises(error, match=re.escape(said)) as raised:
            verifiers_of(index, [], registry)
        assert ("rebuild it" in str(raised.value)) is (mode == "refuse")


def test_a_verifier_cannot_be_named_score():
    from receipt_embed.registry import InvalidComponent, Registry

    with pytest.raises(InvalidComponent, match="registered a verifier named 'score': a search's verified figures"):
        Registry().add("verifier", "thirdparty", "score", dict)
    Registry().add("loss", "thirdparty", "score", dict)  # only the verifiers' figures sit beside the fused score


def test_geometric_data_from_other_params_is_refused():
    from receipt_embed.indexing.verifier_data import pack
    from receipt_embed.verification.geometric import GeometricVerifier

    images = REPO / "data_samples" / "images"
    paths = [str(images / "r0000_phone_a.jpg")]
    verifier, data = _geometric_checks(paths)
    verifier.check_data(data)  # as extracted: accepted
    with pytest.raises(BadInput, match=r"page size is .* where its params extract pages of 1 to 64 \(long_side\)"):
        GeometricVerifier(long_side=64).check_data(data)
    item = data.item(0)
    item["points"] = item["points"].copy()
    item["points"][0, 0] = np.nan
    with pytest.raises(BadInput, match="some point lies outside every page extract gives"):
        verifier.check_data(pack("geometric", [item], lambda row: paths[row]))
