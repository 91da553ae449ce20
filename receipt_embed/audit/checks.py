"""Audit checks from plugins (``register_audit_checks``): extra figures in audit.json and
audit.html, computed on the same embeddings as the built-in figures.

A check is ``check(context) -> dict``; see :class:`AuditContext` for what it can read and
:func:`run_checks` for the result it must return.
"""

from __future__ import annotations

import contextlib
import json
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from receipt_embed.display import quoted
from receipt_embed.errors import BadInput
from receipt_embed.plugin_watch import PluginCalledExit, plugin_code
from receipt_embed.stops import is_real_stop

MAX_SUMMARY_CHARACTERS = 2000  # one line a reader takes in; printed whole in the terminal and the report


@dataclass
class AuditContext:
    """What an audit check can read. Do not modify the arrays."""

    embeddings: np.ndarray  # (N, D) float32, L2-normalised, row i is items[i]
    items: list[dict]  # one dict per row: path, receipt_id, device, ... (items.jsonl)
    labels: np.ndarray  # (N,) int, one label per receipt_id
    attributes: list[str]  # the audited attributes (--attribute), testable ones only
    k: int  # the audit's neighbour count (-k)
    index_path: Path
    _neighbours: dict = field(default_factory=dict, repr=False)

    def values(self, column: str) -> np.ndarray:
        """One column of the items as strings (empty where an item lacks it); a column no item
        has is an error, so a typo cannot pass as a column of blanks."""
        if not any(column in item for item in self.items):
            import difflib

            columns = sorted({key for item in self.items for key in item})
            close = difflib.get_close_matches(column, columns, n=1)
            hint = f" (did you mean {quoted(close[0])}?)" if close else ""
            raise KeyError(f"no item has a column {quoted(column)}{hint}; columns: {', '.join(columns)}")
        return np.array([str(item.get(column, "")) for item in self.items])

    def neighbours(self, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(similarities, indices), each (N, k): every item's k nearest *other* items by
        exact inner product (FAISS), most similar first. Computed once per k."""
        import faiss

        k = min(self.k if k is None else k, len(self.embeddings) - 1)
        if k not in self._neighbours:
            index = faiss.IndexFlatIP(self.embeddings.shape[1])
            index.add(self.embeddings)
            similarities, ids = index.search(self.embeddings, k + 1)
            own = ids == np.arange(len(ids))[:, None]
            # drop each row's own entry (or its last one when an identical vector ranked first)
            keep = np.where(own.any(axis=1, keepdims=True), ~own, np.arange(k + 1)[None, :] < k)
            self._neighbours[k] = (similarities[keep].reshape(len(ids), k), ids[keep].reshape(len(ids), k))
        return self._neighbours[k]


class AuditCheckError(BadInput, RuntimeError):
    """A check raised or returned something that is not a result (fatal with --strict-plugins)."""


def _result(name: str, plugin: str, raw) -> dict:
    """Validate a check's return value into a result dict and an optional plot."""
    from receipt_embed.fileio import json_safe

    if not isinstance(raw, dict):
        raise AuditCheckError(f"returned {type(raw).__name__}, not a dict with a 'figures' dict")
    if not isinstance(raw.get("figures"), dict):
        found = "no 'figures' key" if "figures" not in raw else f"'figures' is a {type(raw['figures']).__name__}"
        raise AuditCheckError(f"returned a dict with {found}; 'figures' must be a dict of JSON-ready values")
    unknown = set(raw) - {"figures", "summary", "flagged", "plot"}
    if unknown:
        raise AuditCheckError(f"returned unknown keys {sorted(unknown)}; allowed: figures, summary, flagged, plot")
    figures = json_safe(raw["figures"])
    try:
        json.dumps(figures, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise AuditCheckError(f"figures are not JSON-ready: {exc}") from None
    if "flagged" in raw and not isinstance(raw["flagged"], (bool, np.bool_)):
        raise AuditCheckError(f"'flagged' must be True or False, got {quoted(raw['flagged'])}")
    if "\n" in str(raw.get("summary", "")):
        raise AuditCheckError("'summary' must be one line")
    if len(str(raw.get("summary", ""))) > MAX_SUMMARY_CHARACTERS:
        raise AuditCheckError(
            f"'summary' is {len(str(raw['summary'])):,} characters; a summary is one line of at most "
            f"{MAX_SUMMARY_CHARACTERS:,} (put data in 'figures')"
        )
    plot = raw.get("plot")
    if plot is not None and not hasattr(plot, "savefig"):
        raise AuditCheckError(f"'plot' must be a matplotlib figure, got {type(plot).__name__}")
    return {
        "plugin": plugin,
        "figures": figures,
        "summary": str(raw.get("summary", "")),
        "flagged": bool(raw.get("flagged", False)),
        "plot": plot,
    }


def parse_check_settings(registry, skip=(), settings=()) -> tuple[set[str], dict[str, dict]]:
    """``--skip-check NAME`` and ``--check-set NAME.KEY=VALUE`` (VALUE read as YAML) into
    (names to skip, parameters by check); unknown check names are errors with a suggestion."""
    import difflib

    names = registry.names("audit_check") if registry is not None else []

    def known(name: str, option: str) -> str:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {quoted(close[0])}?)" if close else ""
            raise BadInput(
                f"{option}: no audit check {quoted(name)}{hint}; checks: {', '.join(names) or '(none registered)'}"
            )
        return name

    skipped = set()
    for name in skip:  # a check that is not installed here is already skipped: a warning, so shared CI scripts work
        if name in names:
            skipped.add(name)
        else:
            warnings.warn(
                f"--skip-check {quoted(name)}: no such audit check here; checks: {', '.join(names) or '(none)'}"
            )
    from receipt_embed.registry import named_settings

    params = named_settings(settings, "--check-set", lambda name: known(name, "--check-set"))
    return skipped, params


class _FailedFactory:
    """Stands in for a check whose factory raised, so it is reported like a failing check."""

    def __init__(self, error: Exception):
        self.error = error

    def __call__(self, context):
        raise self.error


def run_checks(
    registry, context: AuditContext, log=lambda message: None, skip=frozenset(), params: dict | None = None
) -> tuple[dict, dict]:
    """Run every registered audit check but those in ``skip``, each factory called with its
    ``params``. Returns (results for audit.json, plots by name).

    A check that raises or returns a malformed result is reported as a warning naming it and
    recorded with its error (fatal when the plugins were loaded with --strict-plugins)."""
    from receipt_embed.audit.report import _png

    results, plots = {}, {}
    if registry is None:
        return results, plots
    params = params or {}
    for name in registry.names("audit_check"):
        if name in skip:
            continue
        component = registry.get("audit_check", name)
        builtin = component.plugin.startswith("builtin.")
        log(f"audit check {name} ({component.plugin})")
        try:
            check = registry.create("audit_check", name, **params.get(name, {}))
        except Exception as exc:
            hint = (
                "; register the factory that returns check(context), not the check itself"
                if "context" in str(exc) and "missing" in str(exc)
                else ""
            )
            if params.get(name):  # the user's --check-set values: theirs to fix, always fatal
                raise BadInput(f"{exc}{hint}") from None
            check = _FailedFactory(AuditCheckError(f"{exc}{hint}"))  # a plugin bug: reported like a failing check
        try:
            # a plugin's check runs as its hooks do: os._exit is its failure, a child it forks ends there
            with (
                contextlib.nullcontext() if builtin else plugin_code(component.plugin, f"running audit check {name} of")
            ):
                result = _result(name, component.plugin, check(context))
        except BaseException as exc:  # an exit or a KeyboardInterrupt the check raises itself is its failure too
            if is_real_stop(exc):
                raise  # a real stop signal arrived while the check ran
            detail = (
                str(exc)
                if isinstance(exc, (AuditCheckError, PluginCalledExit))
                else "".join(traceback.format_exception_only(type(exc), exc)).strip()
            )
            message = f"audit check {quoted(name)} (plugin {quoted(component.plugin)}) failed: {detail}"
            if registry.strict:
                raise AuditCheckError(message + " (--strict-plugins)") from exc
            warnings.warn(message + "; the audit goes on without it")
            results[name] = {
                "plugin": component.plugin,
                "error": detail,
                "figures": {},
                "summary": "",
                "flagged": False,
                "description": component.description,
            }
            continue
        plot = result.pop("plot")
        if plot is not None:
            plots[name] = _png(plot)
        results[name] = {**result, "description": component.description, "params": params.get(name, {})}
    return results, plots
