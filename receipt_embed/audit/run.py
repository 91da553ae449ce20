"""One audit of an index dir: figures -> audit.json, plots and gallery -> audit.html."""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from receipt_embed.audit.checks import AuditContext, run_checks
from receipt_embed.audit.confine import ImageRoots
from receipt_embed.audit.figures import FlagRule, audit_figures
from receipt_embed.display import printable, quoted
from receipt_embed.errors import BadInput
from receipt_embed.fileio import atomic_write_json, atomic_write_text, json_safe
from receipt_embed.version import __version__

AUDIT_JSON, AUDIT_HTML = "audit.json", "audit.html"


def check_attributes(items: list[dict], attributes: list[str], where) -> None:
    import difflib

    columns = sorted({key for item in items for key in item})
    for attribute in attributes:
        if attribute == "receipt_id":
            raise BadInput("receipt_id is the identity every figure is measured against, not an attribute to audit")
        if attribute not in columns:
            close = difflib.get_close_matches(attribute, columns, n=1)
            hint = f" (did you mean {quoted(close[0])}?)" if close else ""
            raise BadInput(
                f"attribute {quoted(attribute)} is not a column of {where}{hint}; columns: {', '.join(columns)}"
            )


def _gallery(index_dir, labels: np.ndarray, attributes: list[str], count: int, roots) -> list[dict]:
    """The worst failures with thumbnails; only captures ``roots`` (an ImageRoots) allow are read."""
    from receipt_embed.audit.report import thumbnail_or_reason, worst_failures

    def card(row: int) -> dict:
        item = index_dir.items[row]
        allowed = roots.check(row, item.get("path"))
        image, missing = thumbnail_or_reason(item.get("path")) if allowed else (None, None)
        unresolvable = (row, item.get("path")) in roots.unresolvable
        if unresolvable:  # not a file outside the allowed folders: no file at all
            missing = "its path names no file (a NUL byte or a symlink loop)"
        return {
            "row": row,
            "receipt_id": item.get("receipt_id"),
            "path": item.get("path"),
            "thumbnail": image,
            "missing": missing,  # why a capture that may be shown has no image (gone, a FIFO, undecodable)
            "refused": not allowed and not unresolvable,
            **{a: item.get(a) for a in attributes},
        }

    failures = worst_failures(index_dir.embeddings, labels, count)
    return [
        {**f, "query_item": card(f["query"]), "wrong_item": card(f["wrong"]), "positive_item": card(f["positive"])}
        for f in failures
    ]


def run_audit(
    index_path: str | Path,
    attributes: list[str],
    out: str | Path,
    *,
    k: int = 10,
    rule: FlagRule = FlagRule(),
    gallery: int = 8,
    context: tuple[str, ...] = (),
    registry=None,
    skip_checks=frozenset(),
    check_params: dict | None = None,
    images_roots=(),
    log=lambda message: None,
    force: bool = False,
    verify: bool = False,
    shortlist: int = 10,
    progress: bool = False,
) -> dict:
    """Audit an index dir; writes OUT/audit.json and OUT/audit.html and returns the figures.

    With a plugin ``registry``, its audit checks (``register_audit_checks``) run too, but those
    in ``skip_checks``; ``check_params`` (by check name) go to their factories. Thumbnails are
    read only from the dataset's capture folders and ``images_roots`` (see audit.confine). OUT is written
    whole under a writer lock (an existing report is replaced only with ``force``) and may not
    be, or hold, the index dir. ``verify``: the same retrieval figures after the index's verifiers
    re-rank each item's ``shortlist`` (``retrieval.verified``), and the precision-recall curves."""
    from receipt_embed.indexing.index_dir import read_meta
    from receipt_embed.locking import write_lock
    from receipt_embed.outdir import check_replaceable, refuse_own_input
    from receipt_embed.staging import replace_dir

    both = [name for name in dict.fromkeys(context) if name in attributes]
    if both:  # flagged as a shortcut or never flagged: it cannot be both
        raise BadInput(
            f"{quoted(both[0])} is given both as an attribute to audit and as a context attribute; "
            "a column cannot be both audited (and flagged) and used as context (never flagged): give it once"
        )
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise BadInput(f"report dir {out} is a file; the report needs a directory")
    refuse_own_input(out, {"index dir": index_path})
    read_meta(index_path)  # a missing index dir is named before the lock makes the report's parent
    # a report inside the index dir (the default INDEX/audit) is a write to the index dir: hold its
    # lock too, so an `index --force` replacing it cannot run at the same time (either one is refused)
    # (resolved: a symlink to the index dir, or a report inside one, is the same dir)
    inside = Path(os.path.realpath(out)).parent == Path(os.path.realpath(index_path))
    with write_lock(index_path) if inside else nullcontext(), write_lock(out):
        check_replaceable(out, "audit", force)
        figures, html = _audit(
            index_path,
            attributes,
            k=k,
            rule=rule,
            gallery=gallery,
            context=context,
            registry=registry,
            skip_checks=skip_checks,
            check_params=check_params,
            images_roots=images_roots,
            log=log,
            verify=verify,
            shortlist=shortlist,
            progress=progress,
        )
        with replace_dir(out, "audit", force) as staging:
            atomic_write_json(staging / AUDIT_JSON, figures)
            # a path that is not UTF-8 (its bytes kept as surrogates) is shown escaped, as the report's text
            atomic_write_text(staging / AUDIT_HTML, html.encode("utf-8", "backslashreplace").decode("utf-8"))
    return figures


def _audit(
    index_path,
    attributes,
    *,
    k,
    rule,
    gallery,
    context,
    registry,
    skip_checks,
    check_params,
    images_roots,
    log,
    verify=False,
    shortlist=10,
    progress=False,
) -> tuple[dict, str]:
    """The figures and the HTML report of one audit."""
    import warnings

    from receipt_embed.indexing import load_index_dir

    index_dir = load_index_dir(index_path)
    check_attributes(index_dir.items, [*attributes, *context], index_dir.path / "items.jsonl")
    log(printable(f"auditing {index_dir.count} items for {', '.join([*attributes, *context])}"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # degenerate inputs are reported as null figures
        figures = json_safe(
            audit_figures(index_dir.embeddings, index_dir.items, attributes, k=k, rule=rule, context=tuple(context))
        )
    if figures["k"] < k:
        warnings.warn(f"k = {k} is not below the number of other-receipt items; used k = {figures['k']}")
    attributes = list(figures["shortcuts"])  # the testable ones
    meta = index_dir.meta
    figures["dim"] = meta["dim"]
    figures["index"] = {
        "path": str(index_dir.path.resolve()),
        "factory": meta["factory"],
        "features": meta.get("features"),
        "source": meta["source"],
    }

    x = index_dir.embeddings
    labels = np.unique(np.array([str(item["receipt_id"]) for item in index_dir.items]), return_inverse=True)[1]
    curves = None
    if verify:
        from receipt_embed.audit.verified import verified_figures

        if not meta.get("verifiers"):
            from receipt_embed.indexing.index_dir import IndexDirError

            raise IndexDirError(
                f"{index_dir.path} holds no verifier data: build it with `receipt-embed index ... --verify geometric`"
            )
        log(f"verifying each item's {shortlist} nearest with {', '.join(meta.get('verifiers') or {})}")
        values = {
            a: np.array([str(item[a]) for item in index_dir.items]) for a in figures["retrieval"]["cross_attribute"]
        }
        figures["retrieval"]["verified"], curves = verified_figures(
            index_dir, registry, labels, values, shortlist=shortlist, progress=progress
        )
        stored = meta.get("calibration") or {}
        figures["precision_recall"] = {
            "curves": curves,
            "calibrated": {
                kind: {key: stored[kind].get(key) for key in ("threshold", "precision", "recall")}
                for kind in ("embedding", "verified", "verified_image")
                if kind in stored
            },
        }
    check_plots = _plugin_checks(index_dir, labels, attributes, figures, registry, skip_checks, check_params, log)
    log("drawing plots")
    plots = {**_plots(x, labels, index_dir.items, attributes, figures), "checks": check_plots}
    if curves is not None:
        from receipt_embed.audit import report

        plots["precision_recall"] = report.precision_recall(curves, figures["precision_recall"]["calibrated"])
    roots = ImageRoots.for_index(meta, images_roots)
    gallery_cards = _gallery(index_dir, labels, attributes, gallery, roots)
    figures["gallery_refused"] = len(roots.refused)
    if roots.warning():
        warnings.warn(roots.warning())
    html = _report_html(figures, plots, attributes, gallery_cards, gallery, meta["source"])
    return figures, html


def _plugin_checks(index_dir, labels, attributes, figures, registry, skip_checks, check_params, log) -> dict:
    """Run the audit-check plugins on a read-only view of the vectors; their figures go into
    ``figures``, their plots are returned."""
    shared = index_dir.embeddings.view()
    shared.setflags(write=False)  # checks read the audited vectors; they cannot change the rest of the report
    check_context = AuditContext(
        shared, [dict(item) for item in index_dir.items], labels.copy(), list(attributes), figures["k"], index_dir.path
    )
    figures["checks"], check_plots = run_checks(registry, check_context, log=log, skip=skip_checks, params=check_params)
    figures["flagged_checks"] = [name for name, result in figures["checks"].items() if result["flagged"]]
    return check_plots


def _plots(x, labels, items, attributes, figures) -> dict:
    """The report's figures: agreement bars, similarity histograms and 2-D projections."""
    import warnings

    from receipt_embed.audit import report

    values = {a: np.array([str(item[a]) for item in items]) for a in attributes}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # degenerate spaces (e.g. collapsed) still get their plots
        return {
            "agreement": report.agreement_bars(figures["shortcuts"]) if attributes else None,
            "histograms": {a: report.similarity_histogram(x, labels, values[a], a) for a in attributes},
            "projections": {
                **{a: report.projection(x, labels, values[a], f"coloured by {a}") for a in attributes},
                "receipt": report.projection(x, labels, labels, "coloured by receipt", identities=True),
            },
        }


def _report_html(figures, plots, attributes, gallery_cards, gallery, source) -> str:
    from receipt_embed.audit import report

    source_text = (
        f"checkpoint {source.get('checkpoint')}"
        if source.get("kind") == "checkpoint"
        else f"external embeddings {source.get('embeddings')}"
    )
    return report.render_html(
        {
            "figures": figures,
            "plots": plots,
            "attributes": attributes,
            "verdict": verdict_lines(figures),
            "gallery": gallery_cards,
            "gallery_size": gallery,
            "index": {**figures["index"], "source": source_text},
            "max_projected": report.MAX_PROJECTED,
            "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "version": __version__,
        }
    )


def _num(value, digits=3):
    return "-" if value is None else f"{value:.{digits}f}"


def verdict_lines(figures: dict) -> list[str]:
    """The verdict, one finding a line; names and texts from files or plugins are escaped so
    none can add a line of its own (or a terminal control sequence)."""
    lines = []
    for name in figures["flagged"]:
        lines.append(f"SHORTCUT: {name} ({'; '.join(figures['shortcuts'][name]['reasons'])})")
    if figures["collapsed"]:
        lines.append(
            f"COLLAPSED: effective rank {figures['diagnostics']['effective_rank']:.2f}; the embeddings lie "
            "on nearly one line, so no figure can be trusted"
        )
    for name in figures.get("flagged_checks", []):
        result = figures["checks"][name]
        lines.append(f"CHECK {name} ({result['plugin']}): {result['summary'] or 'flagged'}")
    if not lines:
        tested = [a for a, s in figures["shortcuts"].items() if not s["context"]]
        lines.append(f"No shortcut flagged for {', '.join(tested) or 'any attribute'}")
    for name in figures["inconclusive"]:
        lines.append(f"inconclusive for {name}: {'; '.join(figures['shortcuts'][name]['reasons'])}")
    for name, why in figures["untestable"].items():
        lines.append(f"not tested: {name} ({why})")
    for name, result in figures.get("checks", {}).items():
        if "error" in result:
            lines.append(f"check {name} ({result['plugin']}) failed: {result['error']}")
    return [printable(line) for line in lines]


def summary(figures: dict) -> str:
    """A few lines for the terminal: the verdict first."""
    retrieval = figures["retrieval"]
    lines = []
    lines.append(
        f"retrieval over {retrieval['n_queries']} queries: recall@1 {_num(retrieval['recall_at_1'])}, "
        f"recall@5 {_num(retrieval['recall_at_5'])}, recall@10 {_num(retrieval['recall_at_10'])}, "
        f"mAP {_num(retrieval['map'])}"
    )
    if "verified" in retrieval:
        verified = retrieval["verified"]
        lines.append(
            f"verified ({', '.join(verified['verifiers'])}, shortlist {verified['shortlist']}): "
            f"recall@1 {_num(verified['recall_at_1'])}, recall@5 {_num(verified['recall_at_5'])}, "
            f"recall@10 {_num(verified['recall_at_10'])}, mAP {_num(verified['map'])}"
        )
        if "image" in verified:
            image = verified["image"]
            lines.append(
                f"verified, a bare image ({', '.join(image['verifiers'])}): recall@1 {_num(image['recall_at_1'])}, "
                f"mAP {_num(image['map'])}"
            )
    for name, s in figures["shortcuts"].items():
        cross = retrieval["cross_attribute"][name]
        cross_text = (
            f"cross-{name} recall@1 {_num(cross['recall_at_1'])}"
            if cross["n_queries"]
            else f"no receipt has captures with different {name} values"
        )
        role = " (context, never flagged)" if s["context"] else ""
        lines.append(
            f"{name}{role}: {cross_text}; kNN lift {_num(s['lift'], 2)} (agreement "
            f"{_num(s['knn_agreement'])} vs chance {_num(s['base_rate'])}, z {_num(s['lift_z'], 1)}); "
            f"probe {_num(s['probe_accuracy'])} vs chance {_num(s['probe_chance'])} "
            f"on {s['probe_test_items']} held-out items"
        )
    for name, result in figures.get("checks", {}).items():
        if result["summary"] and name not in figures.get("flagged_checks", []):
            lines.append(f"check {name}: {result['summary']}")
    return "\n".join([*verdict_lines(figures), *(printable(line) for line in lines)])
