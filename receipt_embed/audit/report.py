"""The audit's HTML report: one self-contained file (plots and thumbnails inlined as data
URIs), so it can be mailed, attached to a CI run or opened offline.

Plots are matplotlib (Agg backend, no display needed); the page is a jinja2 template with
autoescaping, so metadata from a manifest can never inject markup.
"""

from __future__ import annotations

import base64
import io
from importlib import resources

import numpy as np

from receipt_embed.display import utf8_safe

MAX_PROJECTED = 3000  # points in the 2-D projection plots
MAX_COLOURED_IDENTITIES = 12


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=96, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def literal(text) -> str:
    """Text drawn as written: matplotlib reads a pair of ``$`` as mathtext (and raises at
    draw time on bad mathtext), so every ``$`` in a value from a manifest is escaped; so is a lone
    surrogate (matplotlib refuses a str holding one)."""
    return utf8_safe(str(text)).replace("$", r"\$")


def _figure(width=6.0, height=3.6):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def similarity_histogram(
    x: np.ndarray, labels: np.ndarray, values: np.ndarray, attribute: str, max_items: int = 3000, seed: int = 0
) -> str:
    """Positives against negatives, negatives split by same / other attribute value."""
    from receipt_embed.audit.figures import pair_similarities

    pairs = pair_similarities(x, labels, values, max_items, seed)
    every = np.concatenate([pairs["positive"], pairs["negative"]])
    low = float(np.floor(min(every.min(), 0.0) * 10) / 10) if every.size else -1.0
    bins = np.linspace(low, 1, 61)
    fig, ax = _figure()
    for kind, name, colour in (
        ("positive", "positives (same receipt)", "tab:green"),
        ("same_attr_negative", f"negatives, same {literal(attribute)}", "tab:red"),
        ("cross_attr_negative", f"negatives, other {literal(attribute)}", "tab:blue"),
    ):
        if pairs[kind].size:
            ax.hist(pairs[kind], bins=bins, density=True, histtype="stepfilled", alpha=0.4, color=colour, label=name)
    ax.set_xlabel("cosine similarity")
    ax.set_ylabel("density")
    ax.set_title(f"Similarity of pairs, split by {literal(attribute)}")
    ax.legend(fontsize=8)
    return _png(fig)


def agreement_bars(shortcuts: dict) -> str:
    """Per attribute: kNN agreement among other-receipt neighbours next to its chance rate."""
    names = list(shortcuts)
    fig, ax = _figure(max(4.0, 1.4 * len(names) + 2), 3.4)
    positions = np.arange(len(names))
    ax.bar(positions - 0.2, [shortcuts[n]["knn_agreement"] for n in names], 0.4, label="kNN agreement", color="tab:red")
    ax.bar(positions + 0.2, [shortcuts[n]["base_rate"] for n in names], 0.4, label="chance", color="tab:gray")
    ax.set_xticks(
        positions,
        [f"{literal(n)}\nlift {shortcuts[n]['lift']:.2f}" if shortcuts[n]["lift"] else literal(n) for n in names],
    )
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of other-receipt neighbours\nwith the same value")
    ax.legend(fontsize=8)
    return _png(fig)


def precision_recall(curves: dict, thresholds: dict) -> str:
    """Precision against recall of "the best other capture is the same receipt", one line per
    score (embedding, verified); a calibrated threshold (``thresholds``: kind -> chosen point) is
    marked where index.json holds one."""
    fig, ax = _figure(5.6, 3.8)
    colours = {"embedding": "tab:blue", "verified": "tab:green", "verified_image": "tab:olive"}
    for kind, curve in curves.items():
        if curve:
            ax.plot([p["recall"] for p in curve], [p["precision"] for p in curve], label=kind, color=colours.get(kind))
        chosen = thresholds.get(kind)
        if chosen and chosen.get("threshold") is not None:
            ax.plot(
                [chosen["recall"]],
                [chosen["precision"]],
                "o",
                color=colours.get(kind),
                label=f"{kind} calibrated at {chosen['threshold']:.4g}",
            )
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("recall: duplicates caught")
    ax.set_ylabel("precision: flags that are right")
    ax.set_title("Is the best other capture the same receipt?")
    ax.legend(fontsize=8, loc="lower left")
    return _png(fig)


def projection(
    x: np.ndarray, labels: np.ndarray, colour_by: np.ndarray, title: str, seed: int = 0, identities: bool = False
) -> str:
    """PCA to 2-D, coloured by an attribute, or by a dozen identities (the rest grey)."""
    from sklearn.decomposition import PCA

    subset = np.arange(len(x))
    if len(x) > MAX_PROJECTED:
        subset = np.sort(np.random.default_rng(seed).choice(len(x), MAX_PROJECTED, replace=False))
    components = min(2, x.shape[1])  # a 1-D embedding is drawn on a line (its second axis 0)
    pca = PCA(n_components=components, random_state=seed)
    points = np.zeros((len(subset), 2))
    points[:, :components] = pca.fit_transform(x[subset])
    share = np.zeros(2)
    share[:components] = np.nan_to_num(pca.explained_variance_ratio_)
    fig, ax = _figure(5.6, 4.2)
    colours = colour_by[subset]
    if identities:
        counts = np.unique(labels[subset], return_counts=True)
        multi = counts[0][counts[1] > 1]
        shown = (
            set(
                np.random.default_rng(seed)
                .choice(multi, min(len(multi), MAX_COLOURED_IDENTITIES), replace=False)
                .tolist()
            )
            if len(multi)
            else set()
        )
        rest = np.array([label not in shown for label in labels[subset]])
        ax.scatter(points[rest, 0], points[rest, 1], s=6, color="lightgray")
        for k, label in enumerate(sorted(shown)):
            mask = labels[subset] == label
            ax.scatter(points[mask, 0], points[mask, 1], s=18, color=f"C{k % 10}", marker="os^D"[k // 10 % 4])
    else:
        for k, value in enumerate(sorted(set(colours.tolist()))[:20]):
            mask = colours == value
            ax.scatter(points[mask, 0], points[mask, 1], s=8, color=f"C{k % 10}", label=literal(str(value)[:24]))
        ax.legend(fontsize=7, markerscale=1.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title(literal(title))
    ax.set_xlabel(f"PC 1 ({100 * share[0]:.0f}% of variance)")
    ax.set_ylabel(f"PC 2 ({100 * share[1]:.0f}% of variance)")
    ax.set_xticks([])
    ax.set_yticks([])
    return _png(fig)


def thumbnail(path: str | None, size=(160, 80)) -> str | None:
    """A small JPEG data URI of a capture, or None when the file is gone or unreadable."""
    return thumbnail_or_reason(path, size)[0]


def thumbnail_or_reason(path: str | None, size=(160, 80)) -> tuple[str | None, str | None]:
    """(data URI, None), or (None, why there is no image: "no path", "not a regular file: a FIFO
    (named pipe)", "cannot decode ...") for the report to show in its place."""
    if not path:
        return None, "no path"
    from PIL import Image

    from receipt_embed.images import load_resized

    try:
        image = Image.fromarray(load_resized(path, size))
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "detail", None) or getattr(exc, "strerror", None) or str(exc)
        return None, reason.removeprefix(f"{path}: ")  # the card shows the path already
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii"), None


def worst_failures(x: np.ndarray, labels: np.ndarray, count: int = 8) -> list[dict]:
    """Queries whose nearest neighbour is another receipt, worst first: by how far that
    wrong neighbour outranks the query's best true positive."""
    n = len(x)
    has_positive = np.bincount(labels)[labels] > 1
    members: dict = {}
    for row, label in enumerate(labels.tolist()):
        members.setdefault(label, []).append(row)
    found = []
    for start in range(0, n, 1024):
        rows = np.arange(start, min(n, start + 1024))
        sims = x[rows] @ x.T
        sims[np.arange(len(rows)), rows] = -np.inf
        top = sims.argmax(axis=1)
        for r, row in enumerate(rows):
            if not has_positive[row] or labels[top[r]] == labels[row]:
                continue
            positives = np.array([m for m in members[labels[row]] if m != row])
            best = positives[np.argmax(sims[r, positives])]
            rank = int((sims[r] > sims[r, best]).sum()) + 1
            found.append(
                {
                    "query": int(row),
                    "wrong": int(top[r]),
                    "wrong_similarity": float(sims[r, top[r]]),
                    "positive": int(best),
                    "positive_similarity": float(sims[r, best]),
                    "positive_rank": rank,
                }
            )
    found.sort(key=lambda f: f["positive_similarity"] - f["wrong_similarity"])
    return found[:count]


def _visible(value):
    """A value as the page shows it: autoescaping stops markup, and :func:`printable` shows control
    characters (ESC, a bidi override, a NUL from a manifest value) as escapes instead of writing
    them raw into the page. Markup the template built itself passes as it is."""
    import markupsafe

    from receipt_embed.display import printable

    return printable(value) if isinstance(value, str) and not isinstance(value, markupsafe.Markup) else value


def render_html(context: dict) -> str:
    import jinja2

    template = resources.files("receipt_embed").joinpath("templates/audit.html.j2").read_text(encoding="utf-8")
    environment = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, finalize=_visible)
    environment.filters["num"] = lambda v, digits=3: "-" if v is None else f"{v:.{digits}f}"
    return environment.from_string(template).render(**context)
