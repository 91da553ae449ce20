"""One audit of an index dir: figures -> audit.json, plots and gallery -> audit.html."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from receipt_embed import __version__
from receipt_embed.audit.figures import FlagRule, audit_figures
from receipt_embed.fileio import atomic_write_json, atomic_write_text

AUDIT_JSON, AUDIT_HTML = "audit.json", "audit.html"


def check_attributes(items: list[dict], attributes: list[str], where: str) -> None:
    columns = sorted({key for item in items for key in item})
    for attribute in attributes:
        if attribute not in columns:
            raise ValueError(f"attribute {attribute!r} is not a column of {where}; columns: {', '.join(columns)}")


def _gallery(index_dir, labels: np.ndarray, attributes: list[str], count: int) -> list[dict]:
    from receipt_embed.audit.report import thumbnail, worst_failures

    def card(row: int) -> dict:
        item = index_dir.items[row]
        return {"row": row, "receipt_id": item.get("receipt_id"), "path": item.get("path"),
                "thumbnail": thumbnail(item.get("path")), **{a: item.get(a) for a in attributes}}

    failures = worst_failures(index_dir.embeddings, labels, count)
    return [{**f, "query_item": card(f["query"]), "wrong_item": card(f["wrong"]), "positive_item": card(f["positive"])}
            for f in failures]


def run_audit(index_path: str | Path, attributes: list[str], out: str | Path, *, k: int = 10,
              rule: FlagRule = FlagRule(), gallery: int = 8, log=lambda message: None) -> dict:
    """Audit an index dir; writes OUT/audit.json and OUT/audit.html and returns the figures."""
    from receipt_embed.audit import report
    from receipt_embed.indexing import load_index_dir

    index_dir = load_index_dir(index_path)
    check_attributes(index_dir.items, attributes, index_dir.path / "items.jsonl")
    log(f"auditing {index_dir.count} items for {', '.join(attributes)}")
    figures = audit_figures(index_dir.embeddings, index_dir.items, attributes, k=k, rule=rule)
    meta = index_dir.meta
    figures["dim"] = meta["dim"]
    figures["index"] = {"path": str(index_dir.path.resolve()), "factory": meta["factory"],
                        "features": meta.get("features"), "source": meta["source"]}

    log("drawing plots")
    x = index_dir.embeddings
    receipt_ids = np.array([str(item["receipt_id"]) for item in index_dir.items])
    labels = np.unique(receipt_ids, return_inverse=True)[1]
    values = {a: np.array([str(item[a]) for item in index_dir.items]) for a in attributes}
    plots = {
        "agreement": report.agreement_bars(figures["shortcuts"]),
        "histograms": {a: report.similarity_histogram(x, labels, values[a], a) for a in attributes},
        "projections": {
            **{a: report.projection(x, labels, values[a], f"coloured by {a}") for a in attributes},
            "receipt": report.projection(x, labels, labels, "coloured by receipt", identities=True),
        },
    }
    source = meta["source"]
    source_text = (f"checkpoint {source.get('checkpoint')}" if source.get("kind") == "checkpoint"
                   else f"external embeddings {source.get('embeddings')}")
    html = report.render_html({
        "figures": figures, "plots": plots, "attributes": attributes,
        "gallery": _gallery(index_dir, labels, attributes, gallery),
        "index": {**figures["index"], "source": source_text}, "max_projected": report.MAX_PROJECTED,
        "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "version": __version__,
    })
    out = Path(out)
    atomic_write_json(out / AUDIT_JSON, figures)
    atomic_write_text(out / AUDIT_HTML, html)
    return figures


def summary(figures: dict) -> str:
    """A few lines for the terminal: the verdict first."""
    retrieval = figures["retrieval"]
    lines = []
    if figures["flagged"]:
        for name in figures["flagged"]:
            lines.append(f"SHORTCUT: {name} ({'; '.join(figures['shortcuts'][name]['reasons'])})")
    else:
        lines.append(f"No shortcut flagged for {', '.join(figures['shortcuts']) or 'no attributes'}")

    def num(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    lines.append(f"retrieval over {retrieval['n_queries']} queries: recall@1 {num(retrieval['recall_at_1'])}, "
                 f"recall@5 {num(retrieval['recall_at_5'])}, recall@10 {num(retrieval['recall_at_10'])}, "
                 f"mAP {num(retrieval['map'])}")
    for name, cross in retrieval["cross_attribute"].items():
        s = figures["shortcuts"][name]
        lines.append(f"{name}: cross-{name} recall@1 {num(cross['recall_at_1'])}, kNN lift {num(s['lift'], 2)} "
                     f"(agreement {num(s['knn_agreement'])} vs chance {num(s['base_rate'])}), "
                     f"probe {num(s['probe_accuracy'])} vs chance {num(s['probe_chance'])}")
    return "\n".join(lines)
