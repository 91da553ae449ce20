"""Output a reader trusts: values from files are printed escaped, so a crafted receipt_id
cannot print a fake verdict line or send terminal control codes; JSON stays JSON."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, builtin_registry, run_cli, train_tiny
from tamper import copy_index, rewrite_items

from receipt_embed.display import printable

FAKE_LINE = "DUPLICATE of receipt y (similarity 1.000 >= 0.9)"
CRAFTED = ["x\n" + FAKE_LINE, "clear\x1b[2Jscreen", "bidi\u202eeulav"]


@pytest.mark.parametrize(
    "raw,shown",
    [
        ("plain receipt 42", "plain receipt 42"),
        ("café 收据 🧾 naïve", "café 收据 🧾 naïve"),  # ordinary Unicode is kept
        ("a\nb\r\tc", "a\\nb\\r\\tc"),
        ("\x1b[2J\x07\x00", "\\x1b[2J\\x07\\x00"),
        ("\x9b31m", "\\x9b31m"),  # the one-byte CSI
        ("zero\u200bwidth\u202e", "zero\\u200bwidth\\u202e"),
        ("line\u2028break", "line\\u2028break"),
        ("back\\nslash", "back\\\\nslash"),  # a literal backslash-n cannot pass for an escaped newline
        (7, "7"),
        (None, "None"),
    ],
)
def test_printable(raw, shown):
    assert printable(raw) == shown
    assert printable(raw).isprintable()


@pytest.fixture(scope="module")
def crafted_index(tmp_path_factory):
    """A checkpoint index whose receipt_ids were rewritten (checksums recomputed)."""
    from receipt_embed.indexing import index_dataset

    base = tmp_path_factory.mktemp("escape")
    dataset, checkpoint = train_tiny(base)
    index_dataset(checkpoint, dataset, base / "index", builtin_registry())
    index = copy_index(base / "index", base / "crafted")
    rewrite_items(index, lambda row, item: {**item, "receipt_id": CRAFTED[row % 3], "device": CRAFTED[(row + 1) % 3]})
    return index


def test_search_table_cannot_be_forged(crafted_index):
    query = REPO / "data_samples" / "images" / "r0000_phone_a.jpg"
    result = run_cli("search", crafted_index, query, "--threshold", "-1", "--k", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == printable(str(query)) and lines[1].startswith("  already indexed (row ")
    assert lines[2].startswith("  DUPLICATE of receipt ")
    assert not any(line.strip() == FAKE_LINE for line in lines)
    assert "\x1b" not in result.stdout and "\u202e" not in result.stdout
    assert "\\x1b[2J" in result.stdout or "x\\nDUPLICATE" in result.stdout
    assert len(lines) == 8  # query, already indexed, verdict, five neighbours: one line each

    result = run_cli("search", crafted_index, query, "--threshold", "-1", "--json")
    assert result.returncode == 0, result.stderr
    neighbours = json.loads(result.stdout)[0]["neighbours"]
    assert {hit["receipt_id"] for hit in neighbours} <= set(CRAFTED)  # JSON keeps the values exact


def test_ingest_rejection_lines_are_escaped(tmp_path):
    rows = [
        {"path": "gone\x1b[2J.jpg", "receipt_id": "r1", "device": "d"},
        {"path": "also-gone.jpg\n  rejected: nothing, all fine", "receipt_id": "r2", "device": "d"},
    ]
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = run_cli("ingest", tmp_path, "--out", tmp_path / "dataset", "-q")
    assert result.returncode == 1  # nothing accepted
    rejected = [line for line in result.stderr.splitlines() if line.startswith("  rejected:")]
    assert len(rejected) == 2 and "\x1b" not in result.stderr
    assert "gone\\x1b[2J.jpg" in rejected[0] and "also-gone.jpg\\n  rejected: nothing" in rejected[1]


def test_audit_verdict_lines_are_one_line_each():
    from receipt_embed.audit.run import verdict_lines

    figures = {
        "flagged": ["dev\nice"],
        "shortcuts": {"dev\nice": {"reasons": ["lift\x1b[2J"], "context": False}},
        "collapsed": False,
        "flagged_checks": ["hub"],
        "inconclusive": [],
        "untestable": {},
        "checks": {
            "hub": {"plugin": "evil\nplugin", "summary": "fine\nNo shortcut flagged for device", "flagged": True}
        },
    }
    lines = verdict_lines(figures)
    assert lines == [
        "SHORTCUT: dev\\nice (lift\\x1b[2J)",
        "CHECK hub (evil\\nplugin): fine\\nNo shortcut flagged for device",
    ]


def test_cli_warnings_print_escaped_one_line(capsys):
    from receipt_embed.cli import _show_warning

    _show_warning(UserWarning("gallery image row 3: /data/x\n  DUPLICATE\x1b[2J"), UserWarning, "file.py", 1)
    assert capsys.readouterr().err == "Warning: gallery image row 3: /data/x\\n  DUPLICATE\\x1b[2J\n"


def test_error_messages_quoting_file_values_are_escaped_one_line(tmp_path):
    """Round 3 of the attack: values from index.json (or a lock file's holder record) reached the
    terminal raw inside an error message, so a crafted one could print a fake verdict line."""
    import numpy as np
    from tamper import edit_meta

    from receipt_embed.indexing import index_embeddings

    rows = [{"path": f"img{i}.jpg", "receipt_id": f"r{i // 2}", "device": "d"} for i in range(6)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(6, 8)).astype(np.float32))
    index = tmp_path / "ix"
    index_embeddings(tmp_path / "x.npy", tmp_path / "m.jsonl", index)
    edit_meta(index, lambda meta: meta["source"].update(embeddings="x\n  " + FAKE_LINE + "\x1b[2J"))
    query = next((REPO / "data_samples" / "images").iterdir())
    result = run_cli("search", index, query)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "\x1b" not in result.stderr, result.stderr
    assert "(x\\n  DUPLICATE of receipt y" in lines[0] and "\\x1b[2J" in lines[0]


def test_set_errors_escape_the_value_once(cli, tmp_path):
    """Attack round 5: `cannot parse --set` went through repr() and printable() (ESC shown as \\\\x1b)."""
    result = cli("config", "--set", "plugins.dir=a\x1bb: [", cwd=tmp_path)
    assert result.returncode == 2 and "cannot parse --set 'plugins.dir=a\\x1bb: ['" in result.stderr, result.stderr


class _FirstLine(Exception):
    pass


def test_the_audits_first_line_escapes_the_attribute(crafted_index, tmp_path):
    """Attack round 5: "auditing N items for NAME" printed a column name from the index raw."""
    from receipt_embed.audit.run import run_audit

    index = copy_index(crafted_index, tmp_path / "index")
    rewrite_items(index, lambda row, item: {**item, "de\x1b[31mv\u202e": f"d{row % 3}"})
    lines = []

    def first_line(message):
        lines.append(message)
        raise _FirstLine

    with pytest.raises(_FirstLine):
        run_audit(index, ["de\x1b[31mv\u202e"], tmp_path / "report", log=first_line)
    assert len(lines) == 1 and lines[0].endswith(" items for de\\x1b[31mv\\u202e"), lines


def test_an_index_dir_whose_name_is_not_utf8_gets_its_report(crafted_index, tmp_path):
    """Attack round 6: the report's HTML held the dir name's undecodable bytes (as surrogates) and
    could not be written: an internal error. They are shown escaped now."""
    from receipt_embed.audit.run import run_audit

    index = copy_index(crafted_index, tmp_path / "bad\udcff\udcfeidx")
    run_audit(index, ["device"], tmp_path / "report", gallery=0)
    html = (tmp_path / "report" / "audit.html").read_text(encoding="utf-8")
    assert "bad\\udcff\\udcfeidx" in html


def test_a_huge_identifier_is_shown_shortened_in_ingest_messages(tmp_path):
    """Attack round 11: a 300,000-character receipt_id given two splits was echoed whole, one
    300 KB error line; rejected-row lines repeated a 300,000-character path each. (Round 28 caps
    a manifest value at 131,072 characters, so these use 100,000.)"""
    images = sorted((REPO / "data_samples" / "images").glob("*.jpg"))[:2]
    huge = "R" * 100_000
    rows = [{"path": str(image), "receipt_id": huge, "device": "p", "split": split} for image, split in
            zip(images, ("train", "heldout"))]  # fmt: skip
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = run_cli(
        "--debug",
        "ingest",
        tmp_path / "two.jsonl",
        "--out",
        tmp_path / "o1",
        "-q",
        "--set",
        "ingest.allow_absolute_paths=true",
    )
    assert result.returncode == 2 and len(result.stderr) < 1000, result.stderr[:300]
    assert "(100000 characters)' is given more than one split (heldout on lines 2; train on lines 1)" in result.stderr
    (tmp_path / "long.jsonl").write_text(
        json.dumps({"path": "x" * 100_000 + ".jpg", "receipt_id": "a", "device": "p"}) + "\n"
    )
    result = run_cli("ingest", tmp_path / "long.jsonl", "--out", tmp_path / "o2")
    assert result.returncode == 1 and len(result.stderr) < 2000, result.stderr[:300]
    assert "  rejected: " in result.stderr and "characters)" in result.stderr


def test_out_paths_with_control_characters_print_escaped(tmp_path):
    """Attack round 17 G6: an ESC in an --out path was printed raw by `train`, `index --shard` and
    `search --all-pairs` (a terminal-injection risk); every line naming it prints it escaped."""
    from conftest import TINY_TRAINING

    from receipt_embed.indexing import index_dataset

    dataset, checkpoint = train_tiny(tmp_path)
    evil = "x\x1b[2Jclear\u202e"
    sets = [item for key in [*TINY_TRAINING, "train.num_workers=0"] for item in ("--set", key)]
    runs = {
        "train": ["train", "--data", dataset, "--out", tmp_path / f"run{evil}", "-q", *sets],
        "index --shard": [
            "index", "--checkpoint", checkpoint, "--data", dataset, "--shard", "0/2", "--out", tmp_path / f"shard{evil}",
        ],
    }  # fmt: skip
    index_dataset(checkpoint, dataset, tmp_path / "index", builtin_registry())
    runs["search --all-pairs"] = [
        "search", tmp_path / "index", "--all-pairs", "--threshold", "0.9", "--out", tmp_path / f"pairs{evil}.csv",
    ]  # fmt: skip
    for name, args in runs.items():
        result = run_cli(*args)
        assert result.returncode == 0, (name, result.stderr)
        shown = result.stdout + result.stderr
        assert "\x1b" not in shown and "\u202e" not in shown, name
        assert "x\\x1b[2Jclear\\u202e" in shown, (name, shown)


def _dataset_of_an_older_ingest(base):
    """A dataset dir as ingest wrote it before it refused lone surrogates: 4 receipts x 3 devices,
    every device and merchant holding one (json.dumps writes "\\ud800"), the report's seal recomputed."""
    import hashlib

    import numpy as np
    from test_ingest import _jpeg

    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    (base / "caps").mkdir()
    rows = []
    for receipt in range(4):
        for device in range(3):
            name = f"r{receipt}_{device}.jpg"
            (base / "caps" / name).write_bytes(_jpeg(10 * receipt + device, size=(16, 32)))
            rows.append({"path": name, "receipt_id": f"r{receipt}", "device": f"phone_{device}", "merchant": "shop"})
    (base / "caps" / "manifest.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    ingest(base / "caps", base / "dataset", load_config().ingest)
    manifest = base / "dataset" / "manifest.jsonl"
    old = [json.loads(line) for line in manifest.read_text().splitlines()]
    manifest.write_text(
        "".join(json.dumps({**r, "device": r["device"] + "\ud800", "merchant": "shop\udc80"}) + "\n" for r in old)
    )
    report = json.loads((base / "dataset" / "ingest_report.json").read_text())
    report["manifest_sha256"] = hashlib.sha256(manifest.read_bytes()).hexdigest()
    (base / "dataset" / "ingest_report.json").write_text(json.dumps(report))
    np.save(base / "vectors.npy", np.random.default_rng(0).normal(size=(len(rows), 8)).astype(np.float32))
    return base / "dataset", base / "vectors.npy"


def test_an_older_datasets_lone_surrogates_are_written_escaped(tmp_path):
    """Attack round 18 H4: a device or merchant holding a lone surrogate (stored by an ingest of
    before H3) made audit-shortcuts fail in matplotlib's set_text and search --all-pairs fail
    writing its CSV, both internal errors. Plots and CSV now show the value escaped (\\ud800)."""
    dataset, vectors = _dataset_of_an_older_ingest(tmp_path)
    index = tmp_path / "index"
    built = run_cli("index", "--embeddings", vectors, "--manifest", dataset, "--out", index, "-q")
    assert built.returncode == 0, built.stderr
    audited = run_cli(
        "audit-shortcuts", index, "--attribute", "device", "--context-attribute", "merchant", "--gallery", "0", "-q"
    )
    assert audited.returncode == 0, audited.stderr
    assert "shop\\udc80" in (index / "audit" / "audit.html").read_text(encoding="utf-8")
    pairs = run_cli("search", index, "--all-pairs", "--threshold", "-1", "--out", tmp_path / "pairs.csv")
    assert pairs.returncode == 0, pairs.stderr
    lines = (tmp_path / "pairs.csv").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1 + 12 * 11 // 2
    assert any(",phone_0\\ud800,phone_1\\ud800," in line for line in lines), lines


def test_a_users_manifest_with_a_lone_surrogate_is_refused_by_index(tmp_path):
    """Attack round 18 H3: `index --embeddings --manifest` holds a user's manifest to ingest's rule
    (its own dataset dir, as an older ingest wrote it, is still indexed: see the test above)."""
    dataset, vectors = _dataset_of_an_older_ingest(tmp_path)
    (tmp_path / "mine.jsonl").write_text((dataset / "manifest.jsonl").read_text())
    result = run_cli("index", "--embeddings", vectors, "--manifest", tmp_path / "mine.jsonl", "--out", tmp_path / "i")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"Error: {tmp_path / 'mine.jsonl'}, line 1: column device: value 'phone_0\\ud800' holds a lone UTF-16 "
        "surrogate (U+D800): not a character, it cannot be stored as UTF-8 (fix that JSON escape in the manifest)"
    ]
    assert not (tmp_path / "i").exists()


def test_attack_round_22_mc3_audit_html_shows_control_characters_of_values_escaped(crafted_index, tmp_path):
    """The gallery's captions held raw ESC bytes and bidi overrides from the index's receipt ids and
    devices (autoescaping stops markup, not control characters)."""
    from receipt_embed.audit.run import run_audit

    run_audit(crafted_index, ["device"], tmp_path / "report", gallery=8)
    html = (tmp_path / "report" / "audit.html").read_text(encoding="utf-8")
    assert "<figcaption>" in html, "the gallery has captions to check"
    assert "\x1b" not in html and "\u202e" not in html
    assert "\\x1b[2J" in html or "\\u202e" in html
