"""The second stage of a search: the verifiers an index dir stores re-score its shortlist pair by pair.

A verifier is built with the parameters recorded in ``index.json`` (the gallery's data was
extracted with them: a query extracted otherwise would not compare), runs ``extract`` on the
query once, and ``score`` against each shortlisted item's stored data. The verified score is the
mean of the verifiers' scores (each in [0, 1]); the shortlist is re-ranked by it, ties kept in
embedding order.
"""

from __future__ import annotations

import numpy as np

from receipt_embed.display import quoted
from receipt_embed.indexing.index_dir import IndexDir, IndexDirError


def verifiers_of(index_dir: IndexDir, names: list[str], registry) -> dict:
    """name -> (verifier built with its recorded params, the index's VerifierData); ``names``
    empty: every verifier the index stores. A name it has no data for says how to add it."""
    stored = index_dir.meta.get("verifiers") or {}
    if not stored:
        raise IndexDirError(
            f"{index_dir.path} holds no verifier data: build it with `receipt-embed index ... --verify geometric`"
        )
    wanted = list(dict.fromkeys(names)) or list(stored)
    missing = [name for name in wanted if name not in stored]
    if missing:
        raise IndexDirError(
            f"{index_dir.path} holds no data for verifier {quoted(missing[0])} (it holds {', '.join(stored)}): "
            f"build it with `receipt-embed index ... --verify {missing[0]}`"
        )
    return {
        name: (registry.create("verifier", name, **stored[name]["params"]), index_dir.verifiers[name])
        for name in wanted
    }


def check_pairs(checks: dict, registry, query_path: str, hits: list[dict], limits) -> list[dict]:
    """``hits`` (embedding neighbours of one query) with ``verified`` figures, best verified first."""
    from receipt_embed.images import decode_image
    from receipt_embed.indexing.verifier_data import check_extracted
    from receipt_embed.registry import plugin_errors
    from receipt_embed.userfiles import read_regular

    image = None
    if any(getattr(verifier, "needs_image", True) for verifier, _ in checks.values()):
        image = np.asarray(decode_image(read_regular(query_path, limits[1]), limits[0], name=query_path).image)
    queries = {}
    for name, (verifier, _) in checks.items():
        wants = image if getattr(verifier, "needs_image", True) else None
        with plugin_errors(registry, "verifier", name, f"extracting from {query_path}"):
            queries[name] = check_extracted(name, verifier.extract(wants, {"path": query_path}), query_path)
    checked = []
    for hit in hits:
        figures = {}
        for name, (verifier, data) in checks.items():
            with plugin_errors(registry, "verifier", name, f"scoring {query_path} against {hit['path']}"):
                result = verifier.score(queries[name], data.item(hit["row"]))
            figures[name] = _score(name, result)
        fused = verified_score(figures.values())
        checked.append({**hit, "verified": {"score": round(fused, 6), **figures}})
    order = sorted(range(len(checked)), key=lambda i: (-checked[i]["verified"]["score"], i))
    return [checked[i] for i in order]


def verified_score(results) -> float:
    """The mean score of the verifiers that had evidence: a result with ``abstain`` true (the fields
    verifier when the two captures share no field) is left out; 0.5 when every one abstains."""
    scores = [float(result["score"]) for result in results if not result.get("abstain")]
    return float(np.mean(scores)) if scores else 0.5


def _score(name: str, result) -> dict:
    """A verifier's result, checked: a dict whose ``score`` is a number in [0, 1]."""
    import math

    from receipt_embed.errors import BadInput

    value = result.get("score") if isinstance(result, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not 0 <= float(value) <= 1:
        raise BadInput(f"verifier {quoted(name)} returned a score of {value!r}: it must be a number in [0, 1]")
    if math.isnan(float(value)):
        raise BadInput(f"verifier {quoted(name)} returned a score of nan")
    import json

    from receipt_embed.fileio import json_safe

    figures = json_safe({key: value for key, value in result.items() if key != "score"})
    try:
        json.dumps(figures)
    except (TypeError, ValueError) as exc:
        raise BadInput(f"verifier {quoted(name)} returned figures that are not JSON-ready: {exc}") from None
    return {"score": round(float(value), 6), **figures}
