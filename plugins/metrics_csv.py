"""``on_epoch_end`` example: keep RUN_DIR/metrics.csv, a flat copy of metrics.jsonl.

metrics.jsonl nests its figures (``val.head.recall_at_1``); a spreadsheet wants one row per
epoch and one column per figure. After every epoch this plugin rewrites metrics.csv from
metrics.jsonl, so a resumed run (whose unconfirmed epochs were dropped from metrics.jsonl)
gets a matching CSV. Columns are the dotted paths of every number in any line.

It is also the template for an experiment-tracker plugin: replace the CSV writing with e.g.
``mlflow.log_metrics(flat, step=epoch)`` or ``wandb.log(flat, step=epoch)``.
"""

from __future__ import annotations

import csv
import io
import json

from receipt_embed.fileio import atomic_write_text
from receipt_embed.hookspecs import hookimpl

__version__ = "1.0"
CSV_FILE = "metrics.csv"


def flatten(line: dict, prefix: str = "") -> dict:
    """{"val": {"head": {"recall_at_1": 0.9}}} -> {"val.head.recall_at_1": 0.9}; numbers only."""
    flat = {}
    for key, value in line.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[f"{prefix}{key}"] = value
    return flat


@hookimpl
def on_epoch_end(run_dir, epoch):
    lines = [flatten(json.loads(text)) for text in (run_dir / "metrics.jsonl").read_text().splitlines() if text.strip()]
    columns = list(dict.fromkeys(key for line in lines for key in line))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(lines)
    atomic_write_text(run_dir / CSV_FILE, buffer.getvalue())
