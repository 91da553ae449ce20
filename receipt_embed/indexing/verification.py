"""The second stage of a search: the verifiers an index dir stores re-score its shortlist pair by pair.

A verifier is built with the parameters recorded in ``index.json`` (the gallery's data was
extracted with them: a query extracted otherwise would not compare), runs ``extract`` on the
query once, and ``score`` against each shortlisted item's stored data. The verified score is the
mean of the verifiers' scores (each in [0, 1]) that had evidence; the shortlist is re-ranked by it,
ties kept in embedding order. A verifier may *veto* a pair (the fields verifier when a printed
field both captures carry differs: another receipt, however alike the images look): its verified
score is then 0 whatever the others say, so no threshold makes it a duplicate. A pair on which every
verifier abstained (the fields verifier when the two captures share no field, and no other verifier
selected) has no verified score: it ranks after the scored ones and is never judged a duplicate.
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
    checks = {}
    for name in wanted:
        from receipt_embed.errors import BadInput
        from receipt_embed.registry import ComponentError

        try:
            verifier = registry.create("verifier", name, **stored[name]["params"])
        except ComponentError:
            raise
        except BadInput as exc:  # params index.json records that the verifier refuses: an edited index.json
            raise IndexDirError(
                f"{index_dir.path / 'index.json'}: verifiers.{name}.params: {exc}; rebuild it with "
                f"`receipt-embed index ... --verify {name} --force`"
            ) from None
        data = index_dir.verifiers[name]
        if hasattr(verifier, "check_data"):
            from receipt_embed.errors import BadInput
            from receipt_embed.registry import plugin_errors

            refused = None
            with plugin_errors(registry, "verifier", name, f"checking {stored[name]['file']}"):
                try:
                    verifier.check_data(data)
                except BadInput as exc:  # the verifier's own verdict on the data; any other failure is its bug
                    refused = exc
            if refused is not None:
                exc = refused
                raise IndexDirError(
                    f"{index_dir.path / stored[name]['file']} is not what verifier {quoted(name)} (with the params "
                    f"index.json records) reads: {exc}; rebuild it with `receipt-embed index ... --verify {name} --force`"
                ) from None
        checks[name] = (verifier, data)
    return checks


FIELD_EXAMPLES = {"date": "date=25/12/2018", "total": "total=9.00", "receipt_number": "receipt_number=000123"}


def check_query_fields(checks: dict, fields: dict | None) -> list[str]:
    """A query's printed fields (``search --field``) must each be compared by a selected verifier
    of manifest rows (``needs_image`` false; its ``fields`` attribute, when it has one, lists the
    columns it reads), else the field would be dropped silently and the verdict judged on a
    threshold calibrated for fields that were never compared. Returns notes worth a reviewer's eye:
    one field alone agreeing scores as high as all of them, though many receipts share a date."""
    from receipt_embed.errors import BadInput

    if not fields:
        return []
    readers = {
        name: verifier for name, (verifier, _) in checks.items() if getattr(verifier, "needs_image", True) is False
    }
    if not readers:
        raise BadInput(
            f"--field {next(iter(fields))}: no selected verifier compares printed fields (this search uses "
            f"{', '.join(checks)}, which read the image): add `--verifier fields`, or drop --field"
        )
    columns = {name: getattr(verifier, "fields", None) for name, verifier in readers.items()}
    if any(read is None for read in columns.values()):
        return []  # a verifier of rows that does not say which columns it reads may read any
    read = {column for names in columns.values() for column in names}
    unread = [key for key in fields if key not in read]
    if unread:
        compared = "; ".join(f"{name} compares {', '.join(names)}" for name, names in columns.items())
        raise BadInput(
            f"--field {', '.join(unread)}: no selected verifier compares {'it' if len(unread) == 1 else 'them'} "
            f"({compared}): give those keys, or index with --verify-set fields.fields=[...]"
        )
    for name, verifier in readers.items():
        normalise = getattr(verifier, "normalise", None)
        for key, value in fields.items():
            if callable(normalise) and key in (columns[name] or ()) and not normalise(key, value):
                raise BadInput(
                    f"--field {key}={value}: verifier {name} does not read it as a {key} (it normalises to nothing), "
                    "so it would never be compared: give the value as printed, e.g. "
                    f"{FIELD_EXAMPLES.get(key, 'the text on the receipt')}"
                )
    others = [column for names in columns.values() for column in names if column not in fields]
    if len(fields) == 1 and others:
        (key,) = fields
        return [
            f"--field {key} alone: each pair is judged on that one field, and an agreeing {key} scores as high as "
            f"all fields agreeing, though other receipts can share it; give {', '.join(dict.fromkeys(others))} too "
            "where you have them"
        ]
    return []


def check_pairs(checks: dict, registry, query_path: str, hits: list[dict], limits, fields=None) -> list[dict]:
    """``hits`` (embedding neighbours of one query) with ``verified`` figures, best verified first;
    ``fields``: the query's own manifest-like row (its printed date, total...), if known."""
    from receipt_embed.images import decode_image
    from receipt_embed.indexing.verifier_data import check_extracted
    from receipt_embed.registry import plugin_errors
    from receipt_embed.userfiles import read_regular

    image = None
    if any(getattr(verifier, "needs_image", True) for verifier, _ in checks.values()):
        image = np.asarray(decode_image(read_regular(query_path, limits[1]), limits[0], name=query_path).image)
    queries = {}
    for name, (verifier, _) in checks.items():
        if not fields and getattr(verifier, "needs_image", True) is False:
            continue  # nothing of a bare image to extract (see the scoring below)
        wants = image if getattr(verifier, "needs_image", True) else None
        with plugin_errors(registry, "verifier", name, f"extracting from {query_path}"):
            queries[name] = check_extracted(
                name, verifier.extract(wants, {**(fields or {}), "path": query_path}), query_path
            )
    checked = []
    for hit in hits:
        figures = {}
        for name, (verifier, data) in checks.items():
            if not fields and getattr(verifier, "needs_image", True) is False:
                # a bare image has no manifest row: a verifier of rows has nothing of the query to
                # compare, so it abstains, and the score is the image verifiers' (as calibrated)
                figures[name] = {"score": None, "abstain": True}
                continue
            with plugin_errors(registry, "verifier", name, f"scoring {query_path} against {hit['path']}"):
                figures[name] = score_figures(name, verifier.score(queries[name], data.item(hit["row"])))
        fused = verified_score(figures.values())
        checked.append({**hit, "verified": {"score": None if fused is None else round(fused, 6), **figures}})
    return [checked[i] for i in sorted(range(len(checked)), key=lambda i: _rank_key(checked[i], i))]


def _rank_key(hit: dict, position: int):
    """Best verified score first; pairs without one (every verifier abstained) after, in embedding order."""
    score = hit["verified"]["score"]
    return (score is None, -(score or 0.0), position)


def shortlist_scores(index_dir: IndexDir, checks: dict, shortlist: int, registry=None, progress: bool = False):
    """Every item's ``shortlist`` nearest other items by embedding (N x S rows, -1 where the index is
    smaller) and, per verifier, each pair's score and whether it abstained (N x S each), from the
    stored data of both captures: the leave-one-out view ``calibrate`` and ``audit-shortcuts
    --verify`` read. :func:`fused` turns them into verified scores for any subset of verifiers."""
    import sys

    from tqdm import tqdm

    from receipt_embed.evaluation.retrieval import knn
    from receipt_embed.registry import plugin_errors

    vectors = index_dir.embeddings
    _, ids = knn(vectors, shortlist)  # the query itself dropped, wherever ties place it
    rows = np.full((len(vectors), shortlist), -1, dtype=np.int64)
    per = {
        name: (np.zeros(rows.shape), np.ones(rows.shape, dtype=bool), np.zeros(rows.shape, dtype=bool))
        for name in checks
    }
    with tqdm(
        total=len(vectors), desc="verifying shortlists", unit="item", disable=not progress, file=sys.stderr
    ) as bar:
        for query in range(len(vectors)):
            candidates = [int(row) for row in ids[query] if row >= 0]
            for n, row in enumerate(candidates):
                rows[query, n] = row
                for name, (verifier, data) in checks.items():
                    with plugin_errors(registry, "verifier", name, f"scoring rows {query} and {row}"):
                        result = score_figures(name, verifier.score(data.item(query), data.item(row)))
                    scores, abstains, vetoes = per[name]
                    abstains[query, n] = bool(result.get("abstain"))
                    scores[query, n] = 0.0 if abstains[query, n] else result["score"]
                    vetoes[query, n] = bool(result.get("veto")) and not abstains[query, n]
            bar.update()
    return rows, per


def fused(rows: np.ndarray, per: dict, names) -> np.ndarray:
    """The verified score (:func:`verified_score`) of the verifiers ``names`` for each shortlisted
    pair of :func:`shortlist_scores`; 0 where one of them vetoed the pair; -inf where a shortlist
    slot is empty or every verifier abstained (no evidence: ranked last, never flagged)."""
    total, counted, vetoed = np.zeros(rows.shape), np.zeros(rows.shape), np.zeros(rows.shape, dtype=bool)
    for name in names:
        scores, abstained, vetoes = per[name]
        total += np.where(abstained, 0.0, scores)
        counted += ~abstained
        vetoed |= vetoes
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(counted > 0, total / np.maximum(counted, 1), -np.inf)
    out = np.where(vetoed, 0.0, out)
    return np.where(rows >= 0, out, -np.inf)


def verified_score(results) -> float | None:
    """The mean score of the verifiers that had evidence: a result with ``abstain`` true (the fields
    verifier when the two captures share no field) is left out; None when every one abstains. 0
    when one that had evidence vetoed the pair (``veto`` true: certainly another receipt)."""
    counted = [result for result in results if not result.get("abstain")]
    if not counted:
        return None
    if any(result.get("veto") for result in counted):
        return 0.0
    return float(np.mean([float(result["score"]) for result in counted]))


def score_figures(name: str, result) -> dict:
    """A verifier's result, checked: a dict whose ``score`` is a number in [0, 1] (a Python or
    numpy int or float) and whose ``abstain`` and ``veto``, when given, are true or false."""
    from receipt_embed.errors import BadInput

    value = result.get("score") if isinstance(result, dict) else None
    number = None
    if not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.integer, np.floating)):
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float
            number = None
    if number is None or not 0 <= number <= 1:  # nan fails the range too
        shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
        raise BadInput(f"verifier {quoted(name)} returned a score of {shown}: it must be a number in [0, 1]")
    if "abstain" in result and not isinstance(result["abstain"], (bool, np.bool_)):
        raise BadInput(
            f"verifier {quoted(name)} returned abstain={result['abstain']!r}: it must be true or false "
            "(true: no evidence either way, so the verified score leaves this verifier out)"
        )
    if "veto" in result and not isinstance(result["veto"], (bool, np.bool_)):
        raise BadInput(
            f"verifier {quoted(name)} returned veto={result['veto']!r}: it must be true or false "
            "(true: certainly another receipt, so the pair's verified score is 0)"
        )
    import json

    from receipt_embed.fileio import json_safe

    figures = json_safe({key: value for key, value in result.items() if key != "score"})
    try:
        json.dumps(figures)
    except (TypeError, ValueError) as exc:
        raise BadInput(f"verifier {quoted(name)} returned figures that are not JSON-ready: {exc}") from None
    # an abstaining verifier has no score: null, so no reader averages a placeholder in
    return {"score": None if result.get("abstain") else round(number, 6), **figures}
