"""Ingest: every bad-input case is rejected with its reason; nothing is lost silently."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from receipt_embed.config import load_config
from receipt_embed.images import decode_image
from receipt_embed.ingest import ManifestError, ingest


def _jpeg(seed: int, size=(40, 80), **save) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90, **save)
    return buffer.getvalue()


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def _write_csv(folder: Path, rows: list[str], header="path,receipt_id,device") -> Path:
    manifest = folder / "manifest.csv"
    manifest.write_text("\n".join([header, *rows]) + "\n")
    return manifest


def _settings(**overrides):
    return load_config(overrides=[f"ingest.{k}={v}" for k, v in overrides.items()]).ingest


@pytest.fixture
def bad_folder(tmp_path):
    """A manifest whose rows exercise every rejection reason, plus good rows."""
    images = tmp_path / "caps" / "images"
    images.mkdir(parents=True)
    for i in range(4):
        (images / f"good{i}.jpg").write_bytes(_jpeg(i))
    (images / "empty.jpg").write_bytes(b"")
    (images / "truncated.jpg").write_bytes(_jpeg(10)[:600])
    (images / "text.jpg").write_text("this is not an image\n")
    icon = io.BytesIO()
    Image.new("RGB", (16, 16), "red").save(icon, "ICO")
    (images / "icon.ico").write_bytes(icon.getvalue())
    (images / "huge.png").write_bytes(_png(Image.new("L", (300, 300), 255)))
    (tmp_path / "outside.jpg").write_bytes(_jpeg(20))
    rows = [
        "images/good0.jpg,r1,phone",  # line 2
        "images/good1.jpg,r1,scanner",  # 3
        "images/good2.jpg,r2,phone",  # 4
        "images/missing.jpg,r3,phone",  # 5 missing_file
        "images/empty.jpg,r3,phone",  # 6 empty_file
        "images/truncated.jpg,r4,phone",  # 7 truncated
        "images/text.jpg,r4,phone",  # 8 not_an_image
        "images/icon.ico,r5,phone",  # 9 unsupported_format
        "images/huge.png,r5,phone",  # 10 too_many_pixels (limit 50000)
        "../outside.jpg,r6,phone",  # 11 path_escapes
        f"{tmp_path / 'outside.jpg'},r6,phone",  # 12 absolute_path
        "images/good3.jpg,r7,",  # 13 missing_field (device empty)
        "images/good3.jpg,,phone",  # 14 empty_receipt_id
        "images/good0.jpg,r1,phone",  # 15 repeated_row
        "images,r8,phone",  # 16 not_a_file (a folder)
    ]
    return _write_csv(tmp_path / "caps", rows)


EXPECTED_REASONS = {
    5: "missing_file",
    6: "empty_file",
    7: "truncated",
    8: "not_an_image",
    9: "unsupported_format",
    10: "too_many_pixels",
    11: "path_escapes",
    12: "absolute_path",
    13: "missing_field",
    14: "empty_receipt_id",
    15: "repeated_row",
    16: "not_a_file",
}


def test_each_bad_row_rejected_with_its_reason(bad_folder, tmp_path):
    result = ingest(bad_folder, tmp_path / "out", _settings(max_pixels=50000))
    report = json.loads((tmp_path / "out" / "ingest_report.json").read_text())
    reasons = {entry["line"]: entry["reason"] for entry in report["rejected"]}
    assert reasons == EXPECTED_REASONS
    assert report["counts"] == {
        "rows": 15,
        "accepted": 3,
        "rejected": 12,
        "merged_duplicates": 0,
        "identities": 2,
        "duplicate_conflicts": 0,
    }
    details = {entry["line"]: entry["detail"] for entry in report["rejected"]}
    assert "line 15: same file as line 2" in details[15]
    assert "escapes the manifest folder" in details[11]
    assert "300x300 = 90000 pixels exceeds the limit of 50000" in details[10]
    assert "unsupported image format ICO" in details[9]
    assert details[13] == "line 13: empty device"
    # every row is accounted for: accepted + rejected + merged
    manifest = [json.loads(line) for line in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    assert len(manifest) == 3
    assert {row["line"] for row in manifest} | set(reasons) == set(range(2, 17))
    assert result.report == report


def test_a_file_listed_again_under_another_receipt_or_device_is_named_as_a_labelling_conflict(cli, tmp_path):
    """Attack round 16 (F12): the same file listed under two receipt_ids was only `same file as line 2
    (images//a.jpg)`: the conflict was not said, and the path shown was the repeat's own spelling,
    reading as line 2's."""
    (tmp_path / "images").mkdir()
    for i in range(2):
        (tmp_path / "images" / f"a{i}.jpg").write_bytes(_jpeg(i))
    rows = ["images/a0.jpg,r0,phone_a", "images/./a0.jpg,r0,phone_a", "images//a0.jpg,r9,phone_b", "images/a1.jpg,r1,x"]
    manifest = _write_csv(tmp_path, rows)
    result = cli("ingest", manifest, "--out", tmp_path / "out", "-q")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / "ingest_report.json").read_text())
    assert [(r["line"], r["reason"], r["detail"]) for r in report["rejected"]] == [
        (3, "repeated_row", "line 3: same file as line 2 ('images/a0.jpg' on line 2, 'images/./a0.jpg' here)"),
        (
            4,
            "repeated_row",
            "line 4: same file as line 2 ('images/a0.jpg' on line 2, 'images//a0.jpg' here), labelled differently: "
            "line 2 gives receipt 'r0', this line 'r9'; line 2 gives device 'phone_a', this line 'phone_b' "
            "(one file is one capture: fix the manifest)",
        ),
    ]
    assert "line 2 gives receipt 'r0', this line 'r9'" in result.stderr


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares huge dimensions but holds almost no data: a decompression bomb
    must be refused from its header, before any pixel is decoded."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_decompression_bomb_refused_from_header(tmp_path):
    (tmp_path / "bomb.png").write_bytes(_png_header_only(100_000, 100_000))
    result = ingest(_write_csv(tmp_path, ["bomb.png,r1,phone"]), tmp_path / "out", _settings())
    assert [(r["line"], r["reason"]) for r in result.rejected] == [(2, "too_many_pixels")]
    assert "100000x100000 = 10000000000 pixels exceeds the limit of 89478485" in result.rejected[0]["detail"]


def test_absolute_paths_accepted_with_flag(bad_folder, tmp_path):
    result = ingest(bad_folder, tmp_path / "out", _settings(max_pixels=50000, allow_absolute_paths=True))
    assert 12 not in {entry["line"] for entry in result.rejected}
    assert any(row["receipt_id"] == "r6" and Path(row["path"]).name == "outside.jpg" for row in result.rows)


def test_manifest_rows_carry_checked_facts(tmp_path):
    (tmp_path / "a.jpg").write_bytes(_jpeg(1, size=(30, 50)))
    manifest = _write_csv(tmp_path, ["a.jpg,r1,phone,Shop A"], header="path,receipt_id,device,merchant")
    result = ingest(manifest, tmp_path / "out", _settings())
    row = result.rows[0]
    import hashlib

    assert row["sha256"] == hashlib.sha256((tmp_path / "a.jpg").read_bytes()).hexdigest()
    assert (row["width"], row["height"]) == (30, 50)
    assert row["merchant"] == "Shop A" and row["split"] in ("train", "val", "heldout")
    assert row["path"] == str((tmp_path / "a.jpg").resolve()) and row["manifest_path"] == "a.jpg"
    assert list(row)[:7] == ["path", "receipt_id", "device", "split", "sha256", "width", "height"]


def test_jsonl_row_missing_key_and_numeric_ids(tmp_path):
    (tmp_path / "a.jpg").write_bytes(_jpeg(1))
    (tmp_path / "b.jpg").write_bytes(_jpeg(2))
    (tmp_path / "m.jsonl").write_text(
        '{"path": "a.jpg", "receipt_id": 17, "device": "phone"}\n\n{"path": "b.jpg", "receipt_id": "x"}\n'
    )
    result = ingest(tmp_path / "m.jsonl", tmp_path / "out", _settings())
    assert result.rows[0]["receipt_id"] == "17"
    assert result.rejected == [
        {"line": 3, "path": "b.jpg", "reason": "missing_field", "detail": "line 3: missing device"}
    ]


def test_malformed_csv_names_the_line(tmp_path):
    (tmp_path / "m.csv").write_text('path,receipt_id,device\na.jpg,r1,phone\n"b.jpg"x,r2,phone\n')
    with pytest.raises(ManifestError, match=r"m.csv, line 3: malformed CSV"):
        ingest(tmp_path / "m.csv", tmp_path / "out", _settings())


def test_csv_wrong_field_count_names_the_line(tmp_path):
    (tmp_path / "m.csv").write_text("path,receipt_id,device\na.jpg,r1,phone\nb.jpg,r2\n")
    with pytest.raises(ManifestError, match=r"line 3: expected 3 fields"):
        ingest(tmp_path / "m.csv", tmp_path / "out", _settings())


def test_invalid_json_line_names_the_line(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"path": "a.jpg", "receipt_id": "r", "device": "d"}\n{"path": oops}\n')
    with pytest.raises(ManifestError, match=r"m.jsonl, line 2: invalid JSON"):
        ingest(tmp_path / "m.jsonl", tmp_path / "out", _settings())


def test_missing_required_column_is_a_manifest_error(tmp_path):
    (tmp_path / "m.csv").write_text("path,receipt\na.jpg,r1\n")
    with pytest.raises(ManifestError, match=r"required column\(s\) receipt_id, device not found"):
        ingest(tmp_path / "m.csv", tmp_path / "out", _settings())


def test_exif_orientation_applied(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    (tmp_path / "rot.jpg").write_bytes(_jpeg(3, size=(60, 20), exif=exif.tobytes()))
    result = ingest(_write_csv(tmp_path, ["rot.jpg,r1,phone"]), tmp_path / "out", _settings())
    assert (result.rows[0]["width"], result.rows[0]["height"]) == (20, 60)


def test_unusual_modes_converted_not_rejected(tmp_path):
    cmyk = io.BytesIO()
    cmyk_page = Image.new("CMYK", (10, 12), (0, 0, 0, 0))
    cmyk_page.paste((0, 0, 0, 255), (0, 8, 10, 12))  # ink: a blank page would be rejected as `blank`
    cmyk_page.save(cmyk, "JPEG")
    palette = Image.new("P", (10, 12))
    palette.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    palette.paste(1, (0, 0, 10, 6))
    sixteen_pixels = np.full((12, 10), 65535 // 2, dtype=np.uint16)
    sixteen_pixels[11] = 0  # ink
    sixteen = Image.fromarray(sixteen_pixels)
    alpha = Image.new("RGBA", (10, 12), (0, 0, 0, 0))
    alpha.paste((10, 20, 30, 255), (0, 0, 5, 12))
    files = {"cmyk.jpg": cmyk.getvalue(), "pal.png": _png(palette), "16.png": _png(sixteen), "alpha.png": _png(alpha)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    result = ingest(
        _write_csv(tmp_path, [f"{name},r{i},d" for i, name in enumerate(files)]), tmp_path / "out", _settings()
    )
    assert result.rejected == [] and len(result.rows) == 4
    assert sixteen.mode.startswith("I;16")
    decoded = {name: np.asarray(decode_image(data, 10**6).image) for name, data in files.items()}
    for image in decoded.values():
        assert image.dtype == np.uint8 and image.shape == (12, 10, 3)
    assert decoded["cmyk.jpg"][:6].min() > 240  # CMYK (0,0,0,0) is white paper
    assert tuple(decoded["pal.png"][0, 0]) == (200, 10, 10) and tuple(decoded["pal.png"][11, 0]) == (0, 0, 0)
    assert decoded["16.png"][0, 0, 0] == 127  # 32767 / 65535 * 255, rounded
    assert tuple(decoded["alpha.png"][0, 0]) == (10, 20, 30) and tuple(decoded["alpha.png"][0, 9]) == (255, 255, 255)


def _duplicate_folder(tmp_path):
    same = _jpeg(5)
    for name in ("a.jpg", "a_copy.jpg", "b.jpg", "c.jpg"):
        (tmp_path / name).write_bytes(same if name != "c.jpg" else _jpeg(6))
    return _write_csv(tmp_path, ["a.jpg,r1,phone", "a_copy.jpg,r1,scanner", "b.jpg,r2,phone", "c.jpg,r2,phone"])


def test_same_bytes_same_receipt_merged_and_counted(tmp_path):
    result = ingest(_duplicate_folder(tmp_path), tmp_path / "out", _settings())
    dup = result.report["exact_duplicates"]
    assert result.report["counts"]["merged_duplicates"] == 1
    assert dup["merged"][0]["kept"] == "a.jpg" and dup["merged"][0]["merged"] == [{"path": "a_copy.jpg", "line": 3}]
    # same bytes under r1 and r2: a conflict, both kept and flagged by default
    assert dup["conflicts"][0]["receipt_ids"] == ["r1", "r2"]
    assert dup["conflicts"][0]["paths"] == ["a.jpg", "a_copy.jpg", "b.jpg"]
    flagged = {row["manifest_path"] for row in result.rows if row.get("duplicate_conflict")}
    assert flagged == {"a.jpg", "b.jpg"}
    assert {row["receipt_id"] for row in result.rows} == {"r1", "r2"}


def test_merge_duplicates_joins_identities(tmp_path):
    result = ingest(_duplicate_folder(tmp_path), tmp_path / "out", _settings(merge_duplicates=True))
    assert {row["receipt_id"] for row in result.rows} == {"r1"}
    assert result.report["exact_duplicates"]["joined_identities"] == [{"receipt_id": "r1", "joined": ["r2"]}]
    by_path = {row["manifest_path"]: row for row in result.rows}
    assert set(by_path) == {"a.jpg", "c.jpg"}  # a_copy and b are the same bytes as a
    assert by_path["c.jpg"]["source_receipt_id"] == "r2"
    assert result.report["counts"]["merged_duplicates"] == 2


def _many(tmp_path, n_ids=40, extra_column=None):
    rows = []
    for i in range(n_ids):
        for d in range(2):
            name = f"{i}_{d}.jpg"
            (tmp_path / name).write_bytes(_jpeg(1000 + 2 * i + d, size=(8, 16)))
            rows.append(f"{name},id{i},dev{d}" + (f",{extra_column(i)}" if extra_column else ""))
    header = "path,receipt_id,device" + (",split" if extra_column else "")
    return _write_csv(tmp_path, rows, header=header)


def test_splits_by_identity_deterministic_and_exact(tmp_path):
    manifest = _many(tmp_path)
    first = ingest(manifest, tmp_path / "o1", _settings(seed=3))
    again = ingest(manifest, tmp_path / "o2", _settings(seed=3))
    other = ingest(manifest, tmp_path / "o3", _settings(seed=4))
    split_of = lambda result: {(r["receipt_id"], r["split"]) for r in result.rows}  # noqa: E731
    assert split_of(first) == split_of(again) != split_of(other)
    per_identity = {}
    for rid, split in split_of(first):
        per_identity.setdefault(rid, set()).add(split)
    assert all(len(s) == 1 for s in per_identity.values())
    assert {k: v["identities"] for k, v in first.report["per_split"].items()} == {"train": 32, "val": 4, "heldout": 4}
    assert first.report["captures_per_identity"] == {"2": 40}
    assert first.report["per_device"]["dev0"]["captures"] == 40


def test_existing_split_column_respected(tmp_path):
    manifest = _many(tmp_path, n_ids=10, extra_column=lambda i: "heldout" if i < 3 else "")
    result = ingest(manifest, tmp_path / "out", _settings())
    for row in result.rows:
        if row["receipt_id"] in {"id0", "id1", "id2"}:
            assert row["split"] == "heldout"
    assert result.report["per_split"]["heldout"]["identities"] >= 3


def test_conflicting_split_for_one_receipt_is_an_error(tmp_path):
    (tmp_path / "a.jpg").write_bytes(_jpeg(1))
    (tmp_path / "b.jpg").write_bytes(_jpeg(2))
    manifest = _write_csv(tmp_path, ["a.jpg,r1,p,train", "b.jpg,r1,q,val"], header="path,receipt_id,device,split")
    with pytest.raises(
        ManifestError, match=r"receipt_id 'r1' is given more than one split \(train on lines 2; val on lines 3\)"
    ):
        ingest(manifest, tmp_path / "out", _settings())


def test_cli_exit_codes(cli, bad_folder, tmp_path):
    ok = cli("ingest", bad_folder, "--out", tmp_path / "o1", "--max-pixels", "50000", "--quiet")
    assert ok.returncode == 0, ok.stderr
    assert "rejected 12" in ok.stdout and "1 empty_file" in ok.stdout
    assert "[truncated]" in ok.stderr
    strict = cli("ingest", bad_folder, "--out", tmp_path / "o2", "--strict", "-q")
    assert strict.returncode == 1
    assert (tmp_path / "o2" / "ingest_report.json").is_file()  # the report is still written
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    usage = cli("ingest", tmp_path / "bad.jsonl", "--out", tmp_path / "o3")
    assert usage.returncode == 2 and "bad.jsonl, line 1: invalid JSON" in usage.stderr
    ratios = cli("ingest", bad_folder, "--out", tmp_path / "o4", "--split-ratios", "0.5,0.5")
    assert ratios.returncode == 2 and "expected three ratios" in ratios.stderr
    sums = cli("ingest", bad_folder, "--out", tmp_path / "o5", "--split-ratios", "0.5,0.5,0.5")
    assert sums.returncode == 2 and "ingest.split_ratios" in sums.stderr and "summing to 1" in sums.stderr


def test_a_dataset_dir_given_as_source_is_named_as_one(cli, tmp_path):
    """Attack round 16 (F15): `ingest DATASET_DIR` (ingest's own output given as its input) was told
    to rename nine columns (sha256, width, height, ...) that ingest itself had written."""
    (tmp_path / "caps").mkdir()
    for i in range(2):
        (tmp_path / "caps" / f"a{i}.jpg").write_bytes(_jpeg(i))
    manifest = _write_csv(tmp_path / "caps", ["a0.jpg,r1,phone", "a1.jpg,r2,phone"])
    dataset = tmp_path / "ds"
    ingest(manifest, dataset, _settings())
    for source in (dataset, dataset / "manifest.jsonl"):
        result = cli("ingest", source, "--out", tmp_path / "again")
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip() == (
            f"Error: {dataset} is a dataset dir written by ingest, not a manifest to ingest: pass it to "
            "`train --data` or `index --data` as it is, or ingest the manifest it was made from "
            "(its ingest_report.json names it as source)"
        )
        assert "rename" not in result.stderr and not (tmp_path / "again").exists()


def test_a_captures_folder_given_as_a_dataset_dir_says_to_ingest_it_first(tmp_path):
    """The converse of the test above, met in a new-user trial: `train --data my_receipts` (the folder
    with manifest.csv) said only that manifest.jsonl was not found."""
    from receipt_embed.data.dataset_dir import load_dataset_dir

    (tmp_path / "caps").mkdir()
    (tmp_path / "caps" / "a0.jpg").write_bytes(_jpeg(0))
    _write_csv(tmp_path / "caps", ["a0.jpg,r1,phone"])
    with pytest.raises(FileNotFoundError) as info:
        load_dataset_dir(tmp_path / "caps")
    assert str(info.value) == (
        f"{tmp_path / 'caps' / 'manifest.jsonl'} not found: {tmp_path / 'caps'} holds a manifest.csv, not a dataset "
        f"dir; ingest it first, `receipt-embed ingest {tmp_path / 'caps'} --out DATASET_DIR`, and pass DATASET_DIR"
    )
    with pytest.raises(FileNotFoundError, match="is .* a dataset dir written by `receipt-embed ingest`"):
        load_dataset_dir(tmp_path / "empty")


def test_case_mismatch_in_header_gets_a_hint(tmp_path):
    (tmp_path / "m.csv").write_text("Path,Receipt_ID,device\na.jpg,r1,d\n")
    with pytest.raises(ManifestError, match=r"case-sensitive: rename 'Path' -> 'path', 'Receipt_ID' -> 'receipt_id'"):
        ingest(tmp_path / "m.csv", tmp_path / "out", _settings())


def test_nothing_accepted_exits_1_with_warning(cli, tmp_path):
    _write_csv(tmp_path, ["missing.jpg,r1,phone"])
    result = cli("ingest", tmp_path / "manifest.csv", "--out", tmp_path / "out", "-q")
    assert result.returncode == 1
    assert "Warning: no capture was accepted" in result.stderr


def test_max_pixels_above_pillow_default_is_honoured(tmp_path):
    from receipt_embed.images import ImageRejected

    bomb = _png_header_only(20_000, 20_000)  # 4e8 pixels: over Pillow's own 2 x 89e6 limit
    with pytest.raises(ImageRejected, match="20000x20000 = 400000000 pixels exceeds the limit of 89478485"):
        decode_image(bomb, max_pixels=89_478_485)
    with pytest.raises(ImageRejected) as info:
        decode_image(bomb, max_pixels=500_000_000)
    assert info.value.reason != "too_many_pixels"  # the limit was raised; the data is just short


def test_unclosed_quote_and_bad_encoding_name_the_line(tmp_path):
    (tmp_path / "q.csv").write_text('path,receipt_id,device\na.jpg,r1,phone\n"b.jpg,r2,phone\nc.jpg,r3,phone\n')
    with pytest.raises(ManifestError, match=r"q.csv, line 3: malformed CSV"):
        ingest(tmp_path / "q.csv", tmp_path / "out", _settings())
    (tmp_path / "e.csv").write_bytes(b"path,receipt_id,device\na.jpg,r1,phone\nb\xff.jpg,r2,phone\n")
    with pytest.raises(ManifestError, match=r"e.csv, line 3: not UTF-8 text"):
        ingest(tmp_path / "e.csv", tmp_path / "out", _settings())


def test_a_manifest_with_huge_headers_is_refused_at_once(tmp_path):
    """Attack round 5: 100,000 header columns hung ingest (a quadratic duplicate check); a manifest
    has at most MAX_COLUMNS columns, and a field-count error lists only the first of them."""
    from receipt_embed.ingest.manifest import MAX_COLUMNS

    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "manifest.csv").write_text(",".join(["path", "receipt_id", "device", *map(str, range(100_000))]) + "\n")
    with pytest.raises(ManifestError, match=f"line 1: 100003 columns; a manifest has at most {MAX_COLUMNS}"):
        ingest(wide, tmp_path / "out", load_config().ingest)
    ragged = tmp_path / "ragged"
    ragged.mkdir()
    (ragged / "manifest.csv").write_text(",".join(f"c{i}" for i in range(500)) + "\na,b\n")
    with pytest.raises(ManifestError, match=r"expected 500 fields \(c0, .*, c19, \.\.\. \(480 more\)\), found 2"):
        ingest(ragged, tmp_path / "out", load_config().ingest)


def test_receipt_ids_that_differ_only_in_unicode_normalisation_are_said(tmp_path):
    """Attack round 8: "café" written as one code point and as "e" plus a combining accent were two
    receipts without a word. They stay two (ingest does not rewrite ids), and a warning names both."""
    for seed, name in enumerate(["a.jpg", "b.jpg", "c.jpg", "d.jpg"]):
        (tmp_path / name).write_bytes(_jpeg(seed))
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    manifest = _write_csv(tmp_path, [f"a.jpg,{composed},d", f"b.jpg,{decomposed},d", "c.jpg,r2,d", "d.jpg,R2,d"])
    result = ingest(manifest, tmp_path / "out", _settings())
    assert sorted({row["receipt_id"] for row in result.rows}) == sorted([composed, decomposed, "r2", "R2"])
    lookalikes = [w for w in result.warnings() if "Unicode normalisation" in w]
    assert lookalikes == [
        f"receipt_ids {decomposed!r} (5 code points) and {composed!r} (4 code points) differ only in Unicode "
        "normalisation (NFC/NFD): they are kept as different receipts; write each the same way if it is one receipt"
    ], "case is a real difference (r2, R2) and is not warned about"


def test_a_name_the_file_system_encoding_cannot_write_is_not_called_a_nul_byte(cli, tmp_path):
    """Attack round 8: under LC_ALL=C with UTF-8 mode off, a capture named "ré.jpg" that exists was
    rejected as a path holding a NUL byte. The reason now says what is wrong and how to run instead."""
    (tmp_path / "r\u00e9.jpg").write_bytes(_jpeg(0))
    (tmp_path / "b.jpg").write_bytes(_jpeg(1))
    _write_csv(tmp_path, ["r\u00e9.jpg,r0,a", "b.jpg,r0,b"])
    ascii_only = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": "utf-8"}
    result = cli("ingest", tmp_path, "--out", tmp_path / "out", "-q", env=ascii_only)
    assert result.returncode == 0, result.stderr
    assert (
        "rejected: line 2: path 'r\u00e9.jpg' contains a character this system's file name encoding (ascii) "
        "cannot write: run with a UTF-8 locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1 [unresolvable_path]"
    ) in result.stderr
    assert "NUL" not in result.stderr
    utf8 = cli("ingest", tmp_path, "--out", tmp_path / "out2", "-q", env={"LC_ALL": "C.UTF-8"})
    assert utf8.returncode == 0 and "accepted 2, rejected 0" in utf8.stdout, utf8.stdout + utf8.stderr


def test_lone_surrogates_in_any_manifest_value_are_invalid_values(cli, tmp_path):
    """Attack round 18 H3: JSON allows "\\ud800", which Python reads into a str UTF-8 cannot hold. In
    receipt_id ingest failed with an internal UnicodeEncodeError; in device or metadata it was stored
    and broke audit and search later. A column name or value holding one is now `invalid_value`."""
    rows = [
        {"path": "0.jpg", "receipt_id": "\ud800", "device": "d"},
        {"path": "1.jpg", "receipt_id": "r1", "device": "phone\ud800"},
        {"path": "2.jpg", "receipt_id": "r2", "device": "d", "merchant": "shop\udc80"},
        {"path": "3\ud800.jpg", "receipt_id": "r3", "device": "d"},
        {"path": "4.jpg", "receipt_id": "r4", "device": "d", "note\udfff": "x"},
        {"path": "5.jpg", "receipt_id": "r5", "device": "d", "merchant": "caf\u00e9 \U0001f9fe"},
    ]
    for seed in range(6):
        (tmp_path / f"{seed}.jpg").write_bytes(_jpeg(seed, size=(16, 32)))
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))  # "\ud800" escapes
    result = cli("ingest", tmp_path, "--out", tmp_path / "out", "-q")
    assert result.returncode == 0, result.stderr
    assert "internal error" not in result.stderr and "accepted 1, rejected 5 (5 invalid_value)" in result.stdout
    why = "holds a lone UTF-16 surrogate"
    for shown in (
        f"line 1: receipt_id '\\ud800' {why} (U+D800): not a character, it cannot be stored as UTF-8",
        f"line 2: device 'phone\\ud800' {why} (U+D800)",
        f"line 3: column merchant: value 'shop\\udc80' {why} (U+DC80)",
        f"line 4: path '3\\ud800.jpg' {why} (U+D800)",
        f"line 5: column name 'note\\udfff' {why} (U+DFFF)",
    ):
        assert f"  rejected: {shown}" in result.stderr, result.stderr
    kept = [json.loads(line) for line in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    assert [(row["receipt_id"], row["merchant"]) for row in kept] == [("r5", "caf\u00e9 \U0001f9fe")]


def _png_of(pixels: np.ndarray) -> bytes:
    return _png(Image.fromarray(pixels))


def test_attack_round_20_k1_blank_captures_are_rejected_but_faint_ones_kept(tmp_path):
    """Attack round 20 K1: one-colour captures (a 1x1 PNG, flat grey, an all-white JPEG, a fully
    transparent PNG, a flat 16-bit PNG) all embedded to the same vector and were called
    duplicates across receipts; ingest rejects them as `blank`. A faint capture (pale ink,
    6 levels from the paper) is kept."""
    white = io.BytesIO()
    Image.new("RGB", (60, 120), "white").save(white, "JPEG", quality=75)
    faint = np.full((120, 60, 3), 246, np.uint8)
    faint[40:44, 5:50] = 240  # a line of faded thermal print
    files = {
        "one.png": _png_of(np.array([[[3, 4, 5]]], np.uint8)),
        "grey.png": _png_of(np.full((600, 300, 3), 128, np.uint8)),
        "white.jpg": white.getvalue(),
        "clear.png": _png(Image.new("RGBA", (40, 80), (0, 0, 0, 0))),
        "flat16.png": _png(Image.fromarray(np.full((30, 20), 40000, np.uint16))),
        "nearly.png": _png_of(np.array([[[100, 100, 100], [102, 101, 100]]], np.uint8)),
        "faint.png": _png_of(faint),
        "good.jpg": _jpeg(1),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    result = ingest(
        _write_csv(tmp_path, [f"{name},r{i},d" for i, name in enumerate(files)]), tmp_path / "out", _settings()
    )
    assert sorted(row["manifest_path"] for row in result.rows) == ["faint.png", "good.jpg"]
    reasons = {entry["path"]: entry["reason"] for entry in result.rejected}
    assert set(reasons.values()) == {"blank"} and len(reasons) == 6
    details = {entry["path"]: entry["detail"] for entry in result.rejected}
    assert details["one.png"] == "line 2: one.png: blank, all pixels are one colour: no receipt to embed (1x1, RGB)"
    assert details["nearly.png"].endswith("all pixels are one colour (within 2 levels): no receipt to embed (2x1, RGB)")
    report = json.loads((tmp_path / "out" / "ingest_report.json").read_text())
    assert report["rejected_by_reason"] == {"blank": 6}


def test_attack_round_25_m4_a_split_asked_empty_is_not_warned_about(tmp_path):
    """A val ratio of 0 on purpose was warned about as "too few receipts for the split ratios?"."""
    for seed in range(6):
        (tmp_path / f"{seed}.jpg").write_bytes(_jpeg(seed))
    manifest = _write_csv(tmp_path, [f"{seed}.jpg,r{seed // 2},d" for seed in range(6)])
    asked_empty = ingest(manifest, tmp_path / "a", load_config(overrides=["ingest.split_ratios=[0.5,0,0.5]"]).ingest)
    assert asked_empty.report["per_split"]["val"]["identities"] == 0
    assert not [w for w in asked_empty.warnings() if "split" in w], asked_empty.warnings()
    too_few = ingest(manifest, tmp_path / "b", load_config(overrides=["ingest.split_ratios=[0.9,0.05,0.05]"]).ingest)
    empty = [split for split, counts in too_few.report["per_split"].items() if counts["identities"] == 0]
    assert empty and too_few.warnings()[: len(empty)] == [
        f"the {split} split has no identities (too few receipts for the split ratios?)" for split in empty
    ]
