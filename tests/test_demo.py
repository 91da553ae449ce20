"""The bundled sample set and the demo command, end to end."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ingest_data_samples(cli, tmp_path):
    result = cli("ingest", REPO / "data_samples" / "manifest.csv", "--out", tmp_path / "ds", "-q")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "ds" / "ingest_report.json").read_text())
    assert report["counts"]["accepted"] == 180 and report["counts"]["rejected"] == 0
    assert report["counts"]["identities"] == 60
    assert report["captures_per_identity"] == {"3": 60}
    assert {k: v["identities"] for k, v in report["per_split"].items()} == {"train": 48, "val": 6, "heldout": 6}
    rows = [json.loads(l) for l in (tmp_path / "ds" / "manifest.jsonl").read_text().splitlines()]
    assert {row["merchant"] for row in rows} and all(Path(row["path"]).is_file() for row in rows)


def test_demo_runs_and_names_missing_steps(cli, tmp_path):
    result = cli("demo", "--out", tmp_path / "demo", "-q", cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "demo" / "dataset" / "manifest.jsonl").is_file()
    assert "accepted 180" in result.stdout
    assert "train: not built yet" in result.stdout
