"""The synthetic sample generator: determinism, manifest contract, shops, device looks, CLI."""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from receipt_embed.cli import main
from receipt_embed.samples import (
    DEVICES,
    MANIFEST_COLUMNS,
    PRINTED_FIELDS,
    RENDERED_COLUMNS,
    SHOPS,
    capture_jpeg,
    capture_scans,
    find_scans,
    make_receipt,
    make_samples,
    printed_fields,
    render_receipt,
    select_devices,
    simulate_capture,
)
from receipt_embed.samples.capture import _frame

REPO = Path(__file__).resolve().parents[1]


def read_manifest(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sample_set(tmp_path_factory) -> Path:
    """8 receipts (every shop once) x the 3 default devices."""
    out = tmp_path_factory.mktemp("samples")
    make_samples(out, receipts=8, devices=3, seed=0)
    return out


@pytest.fixture(scope="module")
def all_device_captures() -> dict[str, list[Image.Image]]:
    """Captures of 6 receipts by every device profile, keyed by device name."""
    scans = [render_receipt(make_receipt(3, index)) for index in range(6)]
    return {
        device.name: [simulate_capture(scan, device, seed=100 + i) for i, scan in enumerate(scans)]
        for device in DEVICES
    }


# --- determinism -------------------------------------------------------------------------


def test_same_seed_and_arguments_give_byte_identical_files(tmp_path):
    make_samples(tmp_path / "a", receipts=3, devices=2, seed=7)
    make_samples(tmp_path / "b", receipts=3, devices=2, seed=7)
    first, second = tree_bytes(tmp_path / "a"), tree_bytes(tmp_path / "b")
    assert len(first) == 3 * 2 + 1
    assert first == second


def test_a_larger_set_contains_the_captures_of_a_smaller_one(tmp_path):
    make_samples(tmp_path / "small", receipts=2, devices=1, seed=4)
    make_samples(tmp_path / "large", receipts=3, devices=2, seed=4)
    small, large = tree_bytes(tmp_path / "small"), tree_bytes(tmp_path / "large")
    images = {name: data for name, data in small.items() if name.startswith("images/")}
    assert len(images) == 2
    assert all(large[name] == data for name, data in images.items())


def test_different_seeds_give_different_receipts():
    for index in range(8):
        a, b = make_receipt(0, index), make_receipt(1, index)
        assert (a.items, a.number, a.issued) != (b.items, b.number, b.issued)
        assert render_receipt(a).tobytes() != render_receipt(b).tobytes()


def test_capture_randomness_follows_the_seed():
    scan = render_receipt(make_receipt(0, 0))
    device = DEVICES[0]
    assert capture_jpeg(scan, device, seed=1) == capture_jpeg(scan, device, seed=1)
    assert capture_jpeg(scan, device, seed=1) != capture_jpeg(scan, device, seed=2)


# --- the manifest and the files ----------------------------------------------------------


def test_manifest_lists_one_capture_per_receipt_and_device(sample_set):
    columns, rows = read_manifest(sample_set / "manifest.csv")
    assert columns == list(RENDERED_COLUMNS) == [*MANIFEST_COLUMNS, "date", "total", "receipt_number"]
    assert len(rows) == 8 * 3
    devices = [d.name for d in select_devices(3)]
    by_receipt = defaultdict(list)
    for row in rows:
        assert (sample_set / row["path"]).is_file()
        assert not Path(row["path"]).is_absolute()
        by_receipt[row["receipt_id"]].append(row)
    assert len(by_receipt) == 8
    for captures in by_receipt.values():
        assert sorted(row["device"] for row in captures) == sorted(devices)
        assert len({row["merchant"] for row in captures}) == 1
        for column in PRINTED_FIELDS:  # one paper receipt: its captures carry the same printed fields
            assert len({row[column] for row in captures}) == 1 and captures[0][column], column
    assert {row["merchant"] for row in rows} == {shop.name for shop in SHOPS}


def _drawn_strings(receipt, monkeypatch) -> list[str]:
    """Every string render_receipt draws on the paper, in order."""
    from PIL import ImageDraw

    drawn, draw_text = [], ImageDraw.ImageDraw.text

    def recording(self, xy, text, *args, **kwargs):
        drawn.append(text)
        return draw_text(self, xy, text, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(ImageDraw.ImageDraw, "text", recording)
        render_receipt(receipt)
    return drawn


def test_manifest_fields_are_what_each_receipt_prints(sample_set, monkeypatch):
    """date, total and receipt_number are the strings drawn on the paper: the date the start of
    the date-and-time line, the total the amount beside TOTAL, the number its line."""
    _, rows = read_manifest(sample_set / "manifest.csv")
    for row in rows[::3]:  # one capture of each receipt (the others carry the same, tested above)
        receipt = make_receipt(0, int(row["receipt_id"][1:]))
        drawn = _drawn_strings(receipt, monkeypatch)
        dated = [text for text in drawn if text.startswith(row["date"])]
        assert len(dated) == 1 and len(dated[0]) > len(row["date"])  # the time of day follows on its line
        assert dated[0] == receipt.issued.strftime(receipt.shop.date_format)
        assert drawn[drawn.index("TOTAL") + 1] == row["total"]
        assert row["total"].endswith(f"{receipt.total_cents // 100}.{receipt.total_cents % 100:02d}")
        assert row["receipt_number"] in drawn and receipt.number.startswith(row["receipt_number"])
        assert drawn.index(dated[0]) + 1 == drawn.index(row["receipt_number"])  # the line below the date


def test_the_fields_verifier_tells_same_shop_receipts_apart_on_the_manifest(tmp_path):
    """Captures of one receipt agree on every printed field; two receipts of one shop, which share
    the merchant, differ on the date, total or receipt number (so the verifier scores them 0)."""
    from receipt_embed.verification.fields import DEFAULT_FIELDS, FieldsVerifier

    make_samples(tmp_path, receipts=2 * len(SHOPS), devices=2, seed=0)
    _, rows = read_manifest(tmp_path / "manifest.csv")
    verifier = FieldsVerifier()
    notes = verifier.check_rows(rows)  # the month-first shop's dates past the 12th do not read as dates
    assert not any("never compared" in note for note in notes), notes
    assert all(row["total"] and row["receipt_number"] for row in rows)
    values = {row["path"]: verifier.extract(None, row) for row in rows}
    by_receipt = defaultdict(list)
    for row in rows:
        by_receipt[row["receipt_id"]].append(row["path"])
    for first, second in by_receipt.values():
        judged = verifier.score(values[first], values[second])
        assert judged["score"] == 1.0 and not judged["differ"]
        assert {"total", "receipt_number", "merchant"} <= set(judged["agree"]) <= set(DEFAULT_FIELDS)
    merchants = {row["receipt_id"]: row["merchant"] for row in rows}
    receipts = sorted(by_receipt)
    siblings = [(a, b) for i, a in enumerate(receipts) for b in receipts[i + 1 :] if merchants[a] == merchants[b]]
    assert len(siblings) == len(SHOPS)
    for a, b in siblings:
        judged = verifier.score(values[by_receipt[a][0]], values[by_receipt[b][0]])
        assert judged["score"] == 0.0 and "merchant" in judged["agree"]
        assert {"total", "receipt_number"} & set(judged["differ"])


def test_printed_dates_read_as_dates_with_month_first_ones_swapped_up_to_the_twelfth():
    """Every shop's printed date reads as the receipt's day under the fields verifier's default
    day-first reading, but for the month-first shop: its dates past the 12th cannot be day first
    and so read month first (right), and its others read with day and month swapped, the same for
    every capture of the receipt (so comparisons stay right)."""
    from receipt_embed.verification.fields import normalise_date

    for index in range(6 * len(SHOPS)):
        receipt = make_receipt(1, index)
        read = normalise_date(printed_fields(receipt)["date"])
        day = receipt.issued
        if receipt.shop.date_format.startswith("%m/%d"):
            swapped = f"{day.year:04d}-{day.day:02d}-{day.month:02d}"
            assert read == (day.strftime("%Y-%m-%d") if day.day > 12 else swapped)
        else:
            assert read == day.strftime("%Y-%m-%d"), receipt.shop.name


def test_bundled_samples_manifest_lists_what_their_receipts_print():
    """data_samples/ is make-samples --receipts 60 --devices 3 --seed 0: its manifest's rows are
    the ones that set's receipts give (checked without rendering, for any Pillow version)."""
    columns, rows = read_manifest(REPO / "data_samples" / "manifest.csv")
    assert columns == list(RENDERED_COLUMNS)
    assert len(rows) == 60 * 3
    for row in rows:
        receipt = make_receipt(0, int(row["receipt_id"][1:]))
        assert row["merchant"] == receipt.shop.name
        assert {column: row[column] for column in PRINTED_FIELDS} == printed_fields(receipt)


def test_images_decode_and_are_portrait(sample_set):
    widths = {d.name: d.width for d in DEVICES}
    _, rows = read_manifest(sample_set / "manifest.csv")
    for row in rows:
        with Image.open(sample_set / row["path"]) as image:
            assert image.format == "JPEG"
            image.load()
            assert image.mode == "RGB"
            assert image.width == widths[row["device"]]
            assert image.height >= 1.25 * image.width


# --- receipt content ---------------------------------------------------------------------


def test_amounts_add_up():
    for index in range(16):
        receipt = make_receipt(2, index)
        assert 2 <= len(receipt.items) <= 12
        assert receipt.subtotal_cents == sum(i.quantity * i.unit_cents for i in receipt.items)
        assert receipt.total_cents == receipt.subtotal_cents + receipt.tax_cents
        labels = dict(receipt.payment)
        if "CHANGE" in labels:
            tendered = round(float(labels["CASH"]) * 100)
            assert tendered - round(float(labels["CHANGE"]) * 100) == receipt.total_cents


def _ink(image: Image.Image, receipt) -> np.ndarray:
    """How much ink covers each pixel (0 paper .. 1 ink), whatever the paper and ink tones."""
    green = np.asarray(image, dtype=np.float32)[..., 1]
    paper = receipt.paper_rgb[1]
    return (paper - green) / (paper - receipt.ink)


def test_same_shop_receipts_share_the_template_but_differ_in_content():
    receipts = [make_receipt(0, index) for index in range(2 * len(SHOPS))]
    # Shops take turns, so receipt i and i + len(SHOPS) share a shop.
    for first, second in zip(receipts, receipts[len(SHOPS) :]):
        assert first.shop is second.shop
        assert (first.items, first.number, first.issued) != (second.items, second.number, second.issued)
        header_a = _ink(render_receipt(first), first)[:60]
        header_b = _ink(render_receipt(second), second)[:60]
        assert np.abs(header_a - header_b).max() < 0.05  # the same logo and title, pixel for pixel
        full_a, full_b = _ink(render_receipt(first), first), _ink(render_receipt(second), second)
        assert full_a.shape != full_b.shape or np.abs(full_a - full_b).mean() > 0.01
    headers = {r.shop.name: _ink(render_receipt(r), r)[:60] for r in receipts[: len(SHOPS)]}
    names = sorted(headers)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            same_shape = headers[a].shape == headers[b].shape
            assert not (same_shape and np.abs(headers[a] - headers[b]).max() < 0.05), (a, b)


def test_rendered_receipts_grow_with_their_items():
    shop_receipts = [make_receipt(0, index) for index in range(0, 80, len(SHOPS))]
    heights = {len(r.items): render_receipt(r).height for r in shop_receipts}
    counts = sorted(heights)
    assert len(counts) >= 3
    assert all(heights[a] < heights[b] for a, b in zip(counts, counts[1:]))


# --- devices -----------------------------------------------------------------------------


def _look(image: Image.Image) -> np.ndarray:
    """Device-revealing statistics: colour cast, brightness, sharpness, surroundings."""
    pixels = np.asarray(image, dtype=np.float32)
    gray = pixels.mean(axis=2)
    border = np.concatenate([gray[:6].ravel(), gray[-6:].ravel(), gray[:, :6].ravel(), gray[:, -6:].ravel()])
    sharpness = np.abs(np.diff(gray, axis=0)).mean() + np.abs(np.diff(gray, axis=1)).mean()
    red, green, blue = pixels.reshape(-1, 3).mean(axis=0)
    return np.array([red - blue, green - (red + blue) / 2, gray.mean(), gray.std(), sharpness, border.mean()])


def test_every_device_has_its_own_consistent_look(all_device_captures):
    """Leave-one-out nearest centroid on a few statistics identifies the device every time (the
    default six: the harsher styles share looks with them on purpose, a phone is a phone)."""
    from receipt_embed.samples.devices import DEFAULT_DEVICE_COUNT

    defaults = {device.name for device in DEVICES[:DEFAULT_DEVICE_COUNT]}
    looks = {
        name: np.stack([_look(c) for c in captures])
        for name, captures in all_device_captures.items()
        if name in defaults
    }
    scale = np.concatenate(list(looks.values())).std(axis=0)
    for name, rows in looks.items():
        for i, row in enumerate(rows):
            centroids = {
                other: (np.delete(other_rows, i, axis=0) if other == name else other_rows).mean(axis=0)
                for other, other_rows in looks.items()
            }
            nearest = min(centroids, key=lambda other: np.linalg.norm((row - centroids[other]) / scale))
            assert nearest == name, f"capture {i} of {name} looks like {nearest}"


def test_default_devices_differ_on_every_receipt(all_device_captures):
    """Per receipt: phone_a warm, phone_b cool, scanner neutral and sharper than phone_a."""
    for a, b, scan in zip(*(all_device_captures[n] for n in ("phone_a", "phone_b", "scanner"))):
        warm_a, warm_b, warm_scan = _look(a)[0], _look(b)[0], _look(scan)[0]
        assert warm_a > warm_scan + 10
        assert warm_b < warm_scan - 10
        assert abs(warm_scan) < 1
        assert _look(scan)[4] > 1.5 * _look(a)[4]


def test_raw_pixels_cluster_by_device(all_device_captures):
    """The shortcut audit-shortcuts must catch: a raw-pixel neighbour is from the same device."""
    items = [(name, i, c) for name, captures in all_device_captures.items() for i, c in enumerate(captures)]
    vectors = np.stack(
        [np.asarray(c.resize((12, 24), Image.Resampling.BOX), dtype=np.float32).ravel() for _, _, c in items]
    )
    distances = np.linalg.norm(vectors[:, None] - vectors[None], axis=2)
    same_device = []
    for k, (name, receipt, _) in enumerate(items):
        others = [j for j, (_, r, _) in enumerate(items) if r != receipt]
        nearest = min(others, key=lambda j: distances[k, j])
        same_device.append(items[nearest][0] == name)
    assert np.mean(same_device) >= 0.9


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: d.name)
@pytest.mark.parametrize("aspect", [0.6, 2.0, 6.0])
def test_framing_keeps_the_whole_paper_in_a_portrait_frame(device, aspect):
    paper = Image.new("RGB", (400, round(400 * aspect)), "white")
    for seed in range(20):
        width, height, corners, _ = _frame(paper, device, np.random.default_rng(seed))
        assert width == device.width
        assert 1.25 * width <= height <= 3 * width + 1
        assert (corners >= 0).all() and (corners[:, 0] <= width).all() and (corners[:, 1] <= height).all()
        x, y = corners[:, 0], corners[:, 1]
        area = 0.5 * abs(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1)))
        assert area >= 0.15 * width * height


def test_simulate_capture_accepts_any_scan_mode():
    scan = render_receipt(make_receipt(0, 1))
    for mode in ("L", "RGBA", "RGB"):
        capture = simulate_capture(scan.convert(mode), DEVICES[1], seed=3)
        assert capture.mode == "RGB" and capture.height > capture.width


def test_select_devices_bounds():
    assert [d.name for d in select_devices(2)] == [d.name for d in DEVICES[:2]]
    assert len({d.name for d in DEVICES}) == len(DEVICES)
    for bad in (0, len(DEVICES) + 1):
        with pytest.raises(ValueError, match="devices"):
            select_devices(bad)


# --- scans -------------------------------------------------------------------------------


def _write_scans(folder: Path) -> None:
    folder.mkdir()
    render_receipt(make_receipt(5, 0)).save(folder / "shop-a.png")
    render_receipt(make_receipt(5, 1)).convert("L").save(folder / "shop-b.JPG")
    render_receipt(make_receipt(5, 2)).transpose(Image.Transpose.ROTATE_90).save(folder / "wide.webp")
    (folder / "notes.txt").write_text("not a scan")


def test_capture_scans_writes_the_same_manifest_format(tmp_path):
    _write_scans(tmp_path / "scans")
    scans = find_scans(tmp_path / "scans")
    assert [p.name for p in scans] == ["shop-a.png", "shop-b.JPG", "wide.webp"]
    manifest = capture_scans(scans, tmp_path / "out", devices=2, seed=1)
    columns, rows = read_manifest(manifest)
    assert columns == list(MANIFEST_COLUMNS)
    assert sorted({row["receipt_id"] for row in rows}) == ["shop-a", "shop-b", "wide"]
    assert len(rows) == 3 * 2 and all(row["merchant"] == "" for row in rows)
    for row in rows:
        with Image.open(manifest.parent / row["path"]) as image:
            assert image.height > image.width


def test_capture_scans_rejects_repeated_stems_and_unreadable_files(tmp_path):
    render_receipt(make_receipt(0, 0)).save(tmp_path / "same.png")
    render_receipt(make_receipt(0, 1)).save(tmp_path / "same.jpg")
    with pytest.raises(ValueError, match="unique stems"):
        capture_scans([tmp_path / "same.png", tmp_path / "same.jpg"], tmp_path / "out", devices=1)
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match="broken.jpg"):
        capture_scans([tmp_path / "broken.jpg"], tmp_path / "out", devices=1)
    assert not (tmp_path / "out" / "manifest.csv").exists()


# --- command line ------------------------------------------------------------------------


def test_cli_writes_a_set_with_summary_and_no_bar_off_a_terminal(tmp_path):
    result = CliRunner().invoke(
        main, ["make-samples", "--receipts", "2", "--devices", "2", "--seed", "3", "--out", str(tmp_path / "set")]
    )
    assert result.exit_code == 0, result.output
    assert "Wrote 4 captures (2 receipts x 2 devices: phone_a, phone_b)" in result.stdout
    assert "100%" not in result.stderr  # progress bars only on a terminal
    _, rows = read_manifest(tmp_path / "set" / "manifest.csv")
    assert len(rows) == 4


def test_cli_quiet_and_from_scans(tmp_path):
    _write_scans(tmp_path / "scans")
    result = CliRunner().invoke(
        main,
        [
            "make-samples",
            "--from-scans",
            str(tmp_path / "scans"),
            "--devices",
            "1",
            "--out",
            str(tmp_path / "set"),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert "Wrote 3 captures (3 receipts x 1 devices: phone_a)" in result.stdout


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--devices", str(len(DEVICES) + 1)], "--devices"),
        (["--devices", "0"], "--devices"),
        (["--receipts", "0"], "--receipts"),
        (["--seed", "-1"], "--seed"),
        (["--from-scans", "EMPTY"], "no receipt images"),
        (["--from-scans", "EMPTY", "--receipts", "5"], "cannot be combined"),
    ],
)
def test_cli_rejects_bad_arguments_with_exit_code_2(tmp_path, arguments, message):
    (tmp_path / "empty").mkdir()
    arguments = [str(tmp_path / "empty") if a == "EMPTY" else a for a in arguments]
    result = CliRunner().invoke(main, ["make-samples", "--out", str(tmp_path / "set"), *arguments])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "set" / "manifest.csv").exists()


def test_cli_reports_unreadable_scans_as_input_errors(tmp_path):
    (tmp_path / "scans").mkdir()
    (tmp_path / "scans" / "bad.png").write_bytes(b"\x89PNG but not really")
    result = CliRunner().invoke(
        main, ["make-samples", "--from-scans", str(tmp_path / "scans"), "--out", str(tmp_path / "set"), "--quiet"]
    )
    assert result.exit_code == 2
    assert "bad.png" in result.output


def test_a_scan_that_cannot_be_decoded_is_one_escaped_line_without_a_usage_banner(tmp_path):
    """Attack round 16 (F3): a scan that could not be decoded was reported as a usage error: a
    "Usage: ... Try --help" banner blamed the command line, and the scan's name went to the
    terminal raw, so an ESC sequence in it cleared the screen and faked the output."""
    folder = tmp_path / "scans"
    folder.mkdir()
    render_receipt(make_receipt(5, 0)).save(folder / "a.png")
    evil = "evil\x1b[2J\x1b[1;1HDUPLICATE.png"
    (folder / evil).write_bytes(b"not an image")
    rows = [{"path": "a.png", "scan_id": "A"}, {"path": evil, "scan_id": "C"}]
    (folder / "receipts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = CliRunner().invoke(
        main,
        ["make-samples", "--from-scans", str(folder), "--out", str(tmp_path / "set"), "--devices", "1", "-q"],
        color=True,  # keep what a terminal would get: click strips ESC sequences only off a terminal
    )
    assert result.exit_code == 2, result.output
    assert "Usage:" not in result.output and "--help" not in result.output
    assert "\x1b" not in result.output
    assert result.stderr.startswith(f"Error: cannot read scan '{folder}/evil\\x1b[2J\\x1b[1;1HDUPLICATE.png': ")
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "set").exists()


def test_a_scan_that_decodes_to_more_pixels_than_ingest_takes_is_refused_from_its_header(tmp_path):
    """Attack round 14: `make-samples --from-scans` decoded scans up to PIL's 179 Mpx (it only warns
    above 89 Mpx): a 17 KB 1-bit PNG of 12000 x 12000 took 754 MB and a 734 KB one 3.5 GB."""
    import resource
    import subprocess
    import sys

    (tmp_path / "scans").mkdir()
    Image.new("1", (12000, 12000)).save(tmp_path / "scans" / "bomb.png")
    assert (tmp_path / "scans" / "bomb.png").stat().st_size < 100_000

    def small_memory():  # decoding 144 Mpx needs more than this; reading the header does not
        resource.setrlimit(resource.RLIMIT_AS, (1500 * 2**20, 1500 * 2**20))

    result = subprocess.run(
        [sys.executable, "-m", "receipt_embed", "make-samples", "--from-scans", str(tmp_path / "scans"),
         "--out", str(tmp_path / "set"), "-q"],
        capture_output=True, text=True, timeout=120, preexec_fn=small_memory,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"scan {tmp_path / 'scans' / 'bomb.png'}: 12000x12000 = 144000000 pixels exceeds the limit" in result.stderr
    assert "out of memory" not in result.stderr and not (tmp_path / "set").exists()


def test_cli_help_lists_the_options():
    result = CliRunner().invoke(main, ["make-samples", "--help"])
    assert result.exit_code == 0
    for option in ("--receipts", "--devices", "--seed", "--out", "--from-scans", "--quiet"):
        assert option in result.output


def test_jpeg_bytes_decode_to_the_simulated_capture():
    scan = render_receipt(make_receipt(0, 2))
    data = capture_jpeg(scan, DEVICES[2], seed=9)
    with Image.open(io.BytesIO(data)) as decoded:
        assert np.array_equal(np.asarray(decoded.convert("RGB")), np.asarray(simulate_capture(scan, DEVICES[2], 9)))


def test_scans_listed_with_metadata_carry_it_and_identical_bytes_share_a_receipt(tmp_path):
    """Issue 15: `--from-scans` carries a listing's metadata (company as merchant, date, total) into
    the manifest, and byte-identical scans are one receipt (not a false alarm, not split apart)."""
    import json
    import shutil

    from receipt_embed.samples import read_scans

    folder = tmp_path / "scans"
    (folder / "images").mkdir(parents=True)
    render_receipt(make_receipt(5, 0)).save(folder / "images" / "000.png")
    render_receipt(make_receipt(5, 1)).save(folder / "images" / "001.png")
    shutil.copyfile(folder / "images" / "000.png", folder / "images" / "002.png")  # the same paper scanned twice
    listing = [
        {"path": "images/000.png", "scan_id": "000", "company": "SHOP A", "date": "25/12/2018", "total": 9.0},
        {"path": "images/001.png", "scan_id": "001", "company": "SHOP A", "date": "19/10/2018", "width": 351},
        {"path": "images/002.png", "scan_id": "002", "company": "SHOP A (copy)", "date": "x", "total": "1"},
    ]
    (folder / "receipts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in listing))
    scans = read_scans(folder)
    assert [(s.name, s.receipt_id) for s in scans] == [("000", "000"), ("001", "001"), ("002", "000")]
    manifest = capture_scans(scans, tmp_path / "out", devices=2, seed=1)
    columns, rows = read_manifest(manifest)
    assert columns == [*MANIFEST_COLUMNS, "date", "total"]  # width is what ingest measures itself
    by_path = {row["path"]: row for row in rows}
    assert by_path["images/002_phone_a.jpg"] | {"path": ""} == by_path["images/000_phone_a.jpg"] | {"path": ""}
    assert (
        by_path["images/000_phone_a.jpg"]["merchant"] == "SHOP A"
        and by_path["images/000_phone_a.jpg"]["total"] == "9.0"
    )
    assert by_path["images/001_phone_b.jpg"]["total"] == ""
    out = tmp_path / "out" / "images"
    assert (out / "002_phone_a.jpg").read_bytes() != (out / "000_phone_a.jpg").read_bytes()  # two captures of it

    (folder / "receipts.jsonl").write_text(json.dumps({"path": "../elsewhere.png"}) + "\n")
    with pytest.raises(ValueError, match=r"receipts.jsonl, line 1: '../elsewhere.png' is not a file inside"):
        read_scans(folder)
    (folder / "receipts.jsonl").write_text('{"path": "images/000.png", "company": ["a"]}\n')
    with pytest.raises(ValueError, match="line 1: company is list; metadata must be text or a number"):
        read_scans(folder)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"path": "images/000.png", "scan_id": "../../victim/PRECIOUS"}, "scan name '../../victim/PRECIOUS' cannot"),
        ({"path": "images/000.png", "scan_id": ".."}, "scan name '..' cannot name capture files"),
        ({"path": "images/000.png", "scan_id": "DUP\nDUPLICATE"}, r"scan name 'DUP\nDUPLICATE' cannot"),
        ({"path": "images/000.png", "scan_id": "x" * 300}, "cannot name capture files"),
        ({"path": "images/000.png\u0000x"}, r"line 1: 'images/000.png\x00x' is not a file inside"),
        ({"path": "images/000.png", "scan_id": "x\u0000y"}, r"scan name 'x\x00y' cannot name capture files"),
    ],
)
def test_a_listing_cannot_name_files_outside_the_set(tmp_path, row, message):
    """Attack round 8: a scan_id of ../../victim/PRECIOUS made make-samples overwrite the user's
    victim/PRECIOUS_phone_a.jpg, and a NUL byte was an internal error."""
    folder = tmp_path / "scans"
    (folder / "images").mkdir(parents=True)
    Image.new("RGB", (40, 90), "white").save(folder / "images" / "000.png")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "PRECIOUS_phone_a.jpg").write_text("precious")
    (folder / "receipts.jsonl").write_text(json.dumps(row) + "\n")
    result = CliRunner().invoke(main, ["make-samples", "--out", str(tmp_path / "out"), "--from-scans", str(folder)])
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert (victim / "PRECIOUS_phone_a.jpg").read_text() == "precious" and not (tmp_path / "out").exists()


# --- harsher capture conditions ----------------------------------------------------------


def _gray(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("L"), dtype=np.float32)


def test_each_harsh_condition_does_what_it_says():
    """Each effect measured on a rendered receipt: ink paler, folds darker, a shadowed part,
    bars around a shrunken photo, and nothing but black and white."""
    from receipt_embed.samples import conditions

    paper = render_receipt(make_receipt(0, 2))
    rng = np.random.default_rng(0)
    ink = _gray(paper) < 100
    faded = _gray(conditions.fade_ink(paper, 0.65, rng))
    assert faded[ink].mean() > _gray(paper)[ink].mean() + 60, "the ink is much paler"
    folded = _gray(conditions.crease(Image.new("RGB", (200, 400), "white"), 2, rng))
    assert folded.min(axis=1).min() < 200 and (folded.min(axis=1) > 250).mean() > 0.5, "thin dark folds only"
    shadow = conditions.cast_shadow((400, 200), 0.55, rng)
    assert shadow.min() == pytest.approx(0.45, abs=0.02) and shadow.max() == pytest.approx(1.0, abs=0.02)
    assert 0.05 < (shadow < 0.7).mean() < 0.95, "part of the frame is in shadow, not all of it"
    shot_image, (left, top, scale_x, scale_y) = conditions.screenshot(paper.resize((256, 380)), rng)
    shot = _gray(shot_image)
    assert shot.shape == (380, 256) and shot[:10].mean() < 120 and shot[-20:].mean() < 60
    assert 0.8 * 0.8 <= scale_x <= 0.95 and left > 0 and top >= round(0.06 * 380)
    assert shot[top + 5 : top + 20, left + 5 : left + 20].mean() > 200, "the paper is where it says it put it"
    assert shot[top + 5 : top + 20, left - 4 : left - 1].mean() < 40, "and the dark screen just beside it"
    black_white = np.unique(np.asarray(conditions.binarise(paper)))
    assert set(black_white.tolist()) == {0, 255}


def test_harsh_devices_add_styles_and_leave_the_default_captures_as_they_were():
    """The default six devices draw no randomness for the new steps: their captures are the
    bytes the previous generator wrote (data_samples/ was made with it)."""
    import hashlib

    import PIL

    from receipt_embed.samples.devices import DEFAULT_DEVICE_COUNT, HARSH_DEVICES

    assert DEVICES[DEFAULT_DEVICE_COUNT:] == HARSH_DEVICES and len(HARSH_DEVICES) == 5
    scan = render_receipt(make_receipt(0, 0))
    if (PIL.__version__, np.__version__) == ("13.0.0", "2.4.6"):  # JPEG bytes depend on the encoder's version
        digests = {d.name: hashlib.sha256(capture_jpeg(scan, d, seed=11)).hexdigest()[:16] for d in DEVICES[:3]}
        assert digests == {"phone_a": "3cd3fc7b3263973c", "phone_b": "78086a0b0f56bbd9", "scanner": "04c4251fafbd4bde"}
    for device in HARSH_DEVICES:
        capture = simulate_capture(scan, device, seed=11)
        assert capture.width == device.width and capture.height >= 1.25 * capture.width


@pytest.mark.parametrize("count", ["100001", "99999999999", "1" + "0" * 300])
def test_a_count_it_could_never_finish_is_refused_up_front(tmp_path, count):
    """Attack round 9: `--receipts 99999999999` was accepted and rendered ten receipts a second
    until killed (or until the disk filled)."""
    result = CliRunner().invoke(main, ["make-samples", "--receipts", count, "--out", str(tmp_path / "set")])
    assert result.exit_code == 2, result.output
    assert "Error: Invalid value for --receipts: must be at most 100,000, got " in result.stderr
    assert "make several sets for more" in result.stderr and len(result.stderr) < 600
    assert not (tmp_path / "set").exists()


@pytest.mark.parametrize("hostile", ["link_out", "fifo", "folder", "broken_link"])
def test_a_scan_name_that_is_not_a_file_inside_the_folder_is_refused(tmp_path, hostile):
    """Attack round 10: `make-samples --from-scans DIR` read a `DIR/evil.jpg` link to an image
    outside DIR, and left out a FIFO or a folder named like a scan without a word; a scan listed
    in receipts.jsonl was already refused so."""
    import os

    _write_scans(tmp_path / "scans")
    outside = tmp_path / "secret.png"
    render_receipt(make_receipt(9, 0)).save(outside)
    evil = tmp_path / "scans" / "evil.jpg"
    {
        "link_out": lambda: evil.symlink_to(outside),
        "fifo": lambda: os.mkfifo(evil),
        "folder": lambda: evil.mkdir(),
        "broken_link": lambda: evil.symlink_to(tmp_path / "gone.jpg"),
    }[hostile]()
    result = CliRunner().invoke(
        main, ["make-samples", "--from-scans", str(tmp_path / "scans"), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2, result.output
    what = "a link out of the folder" if hostile == "link_out" else "not a regular file"
    assert f"'{evil}' is {what}: a scan must be a file inside '{tmp_path / 'scans'}'" in result.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("swap", ["fifo", "link_out", "other_image"])
def test_a_scan_swapped_after_it_was_checked_is_refused_by_name_not_captured(tmp_path, swap):
    """Attack round 16 (F2): `make-samples --from-scans` checked and hashed each scan first, then
    opened it again by path to capture it: a scan swapped meanwhile for a FIFO hung the command,
    and one swapped for a link out of the folder was captured into the set. The two steps are
    read_scans and capture_scans, run here with the swap between them."""
    import os
    import threading

    from receipt_embed.samples import read_scans

    folder = tmp_path / "scans"
    folder.mkdir()
    for index in range(3):
        render_receipt(make_receipt(5, index)).save(folder / f"s{index}.png")
    secret = tmp_path / "secret.png"
    Image.new("RGB", (400, 800)).save(secret)
    scans = read_scans(folder)
    victim = folder / "s2.png"
    victim.unlink()
    {
        "fifo": lambda: os.mkfifo(victim),
        "link_out": lambda: victim.symlink_to(secret),
        "other_image": lambda: render_receipt(make_receipt(6, 0)).save(victim),
    }[swap]()

    def unblock():  # a capture blocked on the FIFO gets its end of file (and the test fails, not hangs)
        try:
            os.close(os.open(victim, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass

    guard = threading.Timer(30, unblock)
    guard.start()
    try:
        with pytest.raises(ValueError) as info:
            capture_scans(scans, tmp_path / "out", devices=1)
    finally:
        guard.cancel()
    if swap == "fifo":
        assert str(info.value) == f"cannot read scan '{victim}': is a FIFO (named pipe), not a regular file"
    else:
        assert str(info.value).startswith(f"scan '{victim}' changed while make-samples ran")
    assert not (tmp_path / "out" / "images" / "s2_phone_a.jpg").exists()


def test_listing_fields_ingest_writes_itself_are_kept_renamed_so_the_set_ingests(tmp_path):
    """Attack round 15 (N4): a receipts.jsonl with sha256, bytes or line fields was copied into
    manifest.csv as it was, and ingest then refused the set make-samples had just written."""
    folder = tmp_path / "scans"
    (folder / "images").mkdir(parents=True)
    render_receipt(make_receipt(5, 0)).save(folder / "images" / "000.png")
    row = {"path": "images/000.png", "company": "SHOP A", "sha256": "abc", "bytes": 12, "line": 7, "total": "9"}
    (folder / "receipts.jsonl").write_text(json.dumps(row) + "\n")
    out, data = tmp_path / "out", tmp_path / "data"
    runner = CliRunner()
    made = runner.invoke(main, ["make-samples", "--out", str(out), "--from-scans", str(folder), "--devices", "2"])
    assert made.exit_code == 0, made.output
    assert "field(s) bytes, line, sha256 are written by ingest itself" in made.output
    assert "bytes_given, line_given, sha256_given" in made.output
    columns, rows = read_manifest(out / "manifest.csv")
    assert columns == [*MANIFEST_COLUMNS, "sha256_given", "bytes_given", "line_given", "total"]
    assert {(r["sha256_given"], r["bytes_given"], r["line_given"]) for r in rows} == {("abc", "12", "7")}
    ingested = runner.invoke(main, ["ingest", str(out), "--out", str(data), "--quiet"])
    assert ingested.exit_code == 0, ingested.output
    kept = [json.loads(line) for line in (data / "manifest.jsonl").read_text().splitlines()]
    assert {r["sha256_given"] for r in kept} == {"abc"} and all(len(r["sha256"]) == 64 for r in kept)

    (folder / "receipts.jsonl").write_text(json.dumps(row | {"sha256_given": "x"}) + "\n")
    clash = runner.invoke(main, ["make-samples", "--out", str(tmp_path / "o2"), "--from-scans", str(folder)])
    assert clash.exit_code == 2
    assert "line 1: fields 'sha256' and 'sha256_given' both given" in clash.output, clash.output


def test_listing_scan_ids_split_and_field_names_are_kept_as_given_or_refused_naming_the_line(tmp_path):
    """Attack round 16 (F9): in a receipts.jsonl, `scan_id: 0` silently became the file stem, a
    `split` field became the set's split column (so ingest refused rows of a set make-samples had
    written, or a valid one overrode ingest's split), and field names that were empty or held a
    newline were written into the manifest's header as they were."""
    folder = tmp_path / "scans"
    folder.mkdir()
    for index in range(2):
        render_receipt(make_receipt(5, index)).save(folder / f"s{index}.png")
    rows = [{"path": "s0.png", "scan_id": 0, "company": "A"}, {"path": "s1.png", "company": "A", "split": "bogus"}]
    (folder / "receipts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out, data = tmp_path / "out", tmp_path / "data"
    runner = CliRunner()
    made = runner.invoke(main, ["make-samples", "--out", str(out), "--from-scans", str(folder), "--devices", "1"])
    assert made.exit_code == 0, made.output
    assert "field(s) split are written by ingest itself; the manifest keeps them as split_given" in made.stderr
    columns, written = read_manifest(out / "manifest.csv")
    assert "split" not in columns and "split_given" in columns
    assert [(r["path"], r["receipt_id"], r["split_given"]) for r in written] == [
        ("images/0_phone_a.jpg", "0", ""),
        ("images/s1_phone_a.jpg", "s1", "bogus"),
    ]
    ingested = runner.invoke(main, ["ingest", str(out), "--out", str(data), "--quiet"])
    assert ingested.exit_code == 0, ingested.output
    assert json.loads((data / "ingest_report.json").read_text())["counts"]["rejected"] == 0

    for field, message in [
        ({"scan_id": ""}, "line 2: scan_id '' is not a non-empty string or a finite number"),
        ({"scan_id": ["x"]}, "line 2: scan_id list is not a non-empty string or a finite number"),
        ({"": "empty key"}, "line 2: field name '' cannot name a manifest column"),
        ({"a\nb": "nl"}, "line 2: field name 'a\\nb' cannot name a manifest column"),
        ({"total\u200b": "9"}, "line 2: field name 'total\\u200b' cannot name a manifest column"),
        ({" total": "9"}, "line 2: field name ' total' cannot name a manifest column"),
    ]:
        listing = [rows[0], {"path": "s1.png", **field}]
        (folder / "receipts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in listing))
        refused = runner.invoke(main, ["make-samples", "--out", str(tmp_path / "o2"), "--from-scans", str(folder)])
        assert refused.exit_code == 2, (field, refused.output)
        assert message in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert not (tmp_path / "o2").exists()


def test_listing_merchant_device_and_receipt_id_are_kept_never_dropped(tmp_path):
    """Attack round 19 J5: a receipts.jsonl line with both `merchant` and `company` lost the
    user's merchant without a word (company was written as merchant); a lone `merchant`, and
    `device` or `receipt_id` fields, were dropped the same way."""
    folder = tmp_path / "scans"
    folder.mkdir()
    for index in range(3):
        render_receipt(make_receipt(5, index)).save(folder / f"s{index}.png")
    rows = [
        {"path": "s0.png", "merchant": "m1", "company": "c"},
        {"path": "s1.png", "merchant": "m2", "device": "pixel", "receipt_id": "R9"},
        {"path": "s2.png"},
    ]
    (folder / "receipts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out, data = tmp_path / "out", tmp_path / "data"
    runner = CliRunner()
    made = runner.invoke(main, ["make-samples", "--out", str(out), "--from-scans", str(folder), "--devices", "1"])
    assert made.exit_code == 0, made.output
    assert (
        "field(s) device, merchant, receipt_id are written by make-samples itself (merchant from company, "
        "receipt_id and device for each capture); the manifest keeps them as device_given, merchant_given, "
        "receipt_id_given"
    ) in made.stderr, made.stderr
    columns, written = read_manifest(out / "manifest.csv")
    assert columns == [*MANIFEST_COLUMNS, "merchant_given", "device_given", "receipt_id_given"]
    assert [(r["receipt_id"], r["device"], r["merchant"], r["merchant_given"]) for r in written] == [
        ("s0", "phone_a", "c", "m1"),
        ("s1", "phone_a", "m2", ""),  # no company: the listing's merchant is the merchant
        ("s2", "phone_a", "", ""),
    ]
    assert [(r["device_given"], r["receipt_id_given"]) for r in written] == [("", ""), ("pixel", "R9"), ("", "")]
    ingested = runner.invoke(main, ["ingest", str(out), "--out", str(data), "--quiet"])
    assert ingested.exit_code == 0, ingested.output

    (folder / "receipts.jsonl").write_text(json.dumps(rows[0] | {"merchant_given": "x"}) + "\n")
    clash = runner.invoke(main, ["make-samples", "--out", str(tmp_path / "o2"), "--from-scans", str(folder)])
    assert clash.exit_code == 2 and not (tmp_path / "o2").exists()
    assert clash.stderr.strip() == (
        f"Error: {folder / 'receipts.jsonl'}, line 1: fields 'merchant' and 'merchant_given' both given; "
        "'merchant' is written by make-samples itself and would be kept as 'merchant_given': drop or rename one of them"
    ), clash.stderr


@pytest.mark.parametrize("name", ["phone_a", "phone_shadow", "screenshot", "scanner"])
def test_capture_with_page_box_gives_where_the_paper_lies(name):
    """The true page box (the page detector's ground truth): the capture is paper inside it
    and background just outside it, and the bytes are capture_jpeg's."""
    from receipt_embed.samples import capture_with_page_box

    device = next(d for d in DEVICES if d.name == name)
    paper = Image.new("RGB", (300, 600), "white")
    data, (top, bottom, left, right) = capture_with_page_box(paper, device, seed=4)
    assert data == capture_jpeg(paper, device, seed=4)
    with Image.open(io.BytesIO(data)) as decoded:
        gray = _gray(decoded)
    height, width = gray.shape
    assert 0 <= top < bottom <= height and 0 <= left < right <= width
    inside = gray[top + 4 : bottom - 4, left + 4 : right - 4]
    assert inside.mean() > 100  # white paper, though part of it may lie in a shadow
    if name == "scanner":  # the page fills the frame: nothing outside to compare with
        return
    assert (bottom - top) * (right - left) < 0.95 * height * width
    beside = np.concatenate(
        [
            gray[top + 4 : bottom - 4, max(0, left - 3) : left].ravel(),
            gray[top + 4 : bottom - 4, right : right + 3].ravel(),
        ]
    )
    assert beside.size and inside.mean() - beside.mean() > 25, "the box hugs the paper, not the frame"


@pytest.mark.parametrize(
    "row, message",
    [
        ({"scan_id": "\ud800"}, "line 1: scan_id '\\ud800' holds a lone UTF-16 surrogate (U+D800)"),
        ({"company": "SHOP\udc80"}, "line 1: company 'SHOP\\udc80' holds a lone UTF-16 surrogate (U+DC80)"),
        ({"date": ["\ud800"]}, "line 1: date '\\ud800' holds a lone UTF-16 surrogate"),
        ({"\ud800": "x"}, "line 1: field name '\\ud800' holds a lone UTF-16 surrogate"),
    ],
)
def test_a_listing_value_with_a_lone_surrogate_is_named(tmp_path, row, message):
    """Attack round 18 H3: a receipts.jsonl `scan_id` or `company` of "\\ud800" (JSON allows it; UTF-8
    cannot hold it) was an internal UnicodeEncodeError. Any field name or value holding one is refused
    naming the line, and no set is written."""
    folder = tmp_path / "scans"
    folder.mkdir()
    Image.new("RGB", (40, 90), "white").save(folder / "000.png")
    (folder / "receipts.jsonl").write_text(json.dumps({"path": "000.png", **row}) + "\n")
    result = CliRunner().invoke(main, ["make-samples", "--out", str(tmp_path / "out"), "--from-scans", str(folder)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "fix that JSON escape in receipts.jsonl" in result.output, result.output
    assert "internal error" not in result.output and not (tmp_path / "out").exists()


def _bar_scan(value_of) -> np.ndarray:
    """An 80 x 120 scan: paper and a dark bar, each given as ``value_of(8-bit level)``."""
    pixels = np.full((120, 80), value_of(240))
    pixels[50:70] = value_of(20)
    return pixels


def test_16_bit_and_float_scans_keep_their_ink(tmp_path):
    """Attack round 20 K5: make-samples --from-scans turned a 16-bit greyscale scan into blank
    paper (Image.convert("RGB") clips 16-bit values to 255); a scan now goes through ingest's
    conversion, so 16-bit and 0..1 float scans are captured exactly like their 8-bit version."""
    scans = {
        "l8": Image.fromarray(_bar_scan(lambda level: level).astype(np.uint8)),
        "i16": Image.fromarray(_bar_scan(lambda level: level * 257).astype(np.uint16)),
        "f": Image.fromarray(_bar_scan(lambda level: level / 255).astype(np.float32)),
    }
    assert scans["i16"].mode == "I;16" and scans["f"].mode == "F"
    captures = {}
    for name, scan in scans.items():
        (tmp_path / name).mkdir()
        scan.save(tmp_path / name / ("scan.tif" if name == "f" else "scan.png"))
        result = CliRunner().invoke(
            main, ["make-samples", "--from-scans", str(tmp_path / name), "--out", str(tmp_path / f"set-{name}"),
                   "--devices", "2", "-q"],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        captures[name] = tree_bytes(tmp_path / f"set-{name}" / "images")
    assert captures["i16"] == captures["l8"] and captures["f"] == captures["l8"]
    with Image.open(io.BytesIO(captures["i16"]["scan_phone_a.jpg"])) as capture:
        assert np.asarray(capture.convert("L")).min() < 100  # the bar, not blank paper


def test_a_float_scan_with_no_finite_pixel_is_refused_by_name(tmp_path):
    """Attack round 20 K5: a float scan with nothing finite to scale by is refused naming it."""
    (tmp_path / "scans").mkdir()
    Image.fromarray(np.full((12, 10), np.nan, dtype=np.float32)).save(tmp_path / "scans" / "nan.tif")
    result = CliRunner().invoke(
        main, ["make-samples", "--from-scans", str(tmp_path / "scans"), "--out", str(tmp_path / "set"), "-q"]
    )
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: scan '{tmp_path / 'scans' / 'nan.tif'}': cannot decode (no finite pixel values: every pixel is "
        "NaN or infinite)\n"
    )
    assert not (tmp_path / "set").exists()


def test_scans_in_formats_ingest_does_not_read_are_refused_before_any_decoder_runs(tmp_path):
    """Attack round 20 K6: make-samples --from-scans opened any format Pillow detects by content: a
    GIF listed in receipts.jsonl was captured, and an EPS file named .png was handed to Ghostscript
    ("Unable to locate Ghostscript on paths"). Only ingest's formats are opened now."""
    eps = tmp_path / "eps"
    eps.mkdir()
    (eps / "scan.png").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 100 100\nshowpage\n")
    listed = tmp_path / "listed"
    listed.mkdir()
    render_receipt(make_receipt(5, 0)).convert("P").save(listed / "a.gif")
    (listed / "receipts.jsonl").write_text('{"path": "a.gif", "scan_id": "x"}\n')
    for folder, scan in ((eps, eps / "scan.png"), (listed, listed / "a.gif")):
        result = CliRunner().invoke(
            main, ["make-samples", "--from-scans", str(folder), "--out", str(tmp_path / "set"), "--devices", "2", "-q"]
        )
        assert result.exit_code == 2, result.output
        assert result.stderr == (
            f"Error: cannot read scan '{scan}': not a BMP, JPEG, MPO, PNG, TIFF or WEBP image "
            "(the formats ingest reads)\n"
        )
        assert not (tmp_path / "set").exists()
