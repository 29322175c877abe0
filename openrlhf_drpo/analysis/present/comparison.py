"""drpo-analyze's side-by-side table: one row per objective (or per value of a sweep), the weight's
range, each sign's boundaries, smoothness, boundedness and geometry, in 100 columns."""
from __future__ import annotations

import textwrap

from openrlhf_drpo.analysis.mathtext import math_text
from openrlhf_drpo.analysis.present.summary import weight_range


def comparison(results: list, first: str = "objective") -> str:
    """One row per objective (or per value of a sweep: `first` names the column), side by side, in
    WIDTH columns: a cell past its column's width wraps onto more lines of its row (a name only
    between words: its column is as wide as its longest word)."""
    rows = comparison_rows(results, first)
    caps = (15, 12, 18, 18, 6, 7, 10)     # 100 columns with the gaps
    widths = [min(cap, max(len(r[i]) for r in rows)) for i, cap in enumerate(caps)]
    widths[0] = max([widths[0], *(len(word) for r in rows for word in r[0].split())])
    out = []
    for k, row in enumerate(rows):
        cells = [textwrap.wrap(c, w, break_on_hyphens=i == 6) or [""] for i, (c, w) in enumerate(zip(row, widths))]
        for i in range(max(map(len, cells))):
            out.append("  ".join((c[i] if i < len(c) else "").ljust(w) for c, w in zip(cells, widths)).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def comparison_rows(results: list, first: str = "objective") -> list[list[str]]:
    """comparison's cells: its head, then one row per result."""
    head = [first, "w range", "boundary A>0 (π)", "boundary A<0 (π)", "smooth", "bounded", "geometry"]
    rows = [head]
    for res in results:
        def side(adv):
            b = res.boundary[adv]
            parts = [math_text(p) + ("" if ok else " (unreachable)") for p, ok in zip(b["pi"], b["reachable"])]
            return ", ".join(parts + [x["where"] + " (numeric)" for x in b["numeric"]]) or "none"
        rows.append([res.name, weight_range(res), side("positive"), side("negative"),
                     "yes" if res.smooth else "no", {True: "yes", False: "no", None: "unknown"}[res.bounded], res.geometry])
    return rows
