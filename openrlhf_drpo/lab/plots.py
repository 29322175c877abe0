"""drpo-lab's curves: per objective, the mean over seeds at each step with its 95% t band, one
panel per measure (results.curves)."""
from __future__ import annotations

import math

from openrlhf_drpo.lab.results import RANGES, interval

# (key, title, log axis)
PANELS = [("reward", "reward", False), ("entropy", "policy entropy (nats/token)", False),
          ("past_boundary", "fraction past the boundary", False), ("ess", "ESS of r, (Σr)²/(n·Σr²) (min)", False),
          ("grad_norm", "grad norm before clipping (max)", True), ("max_abs_wr", "max |w·r| = |∂ℓ/∂log π|/|A|", True),
          ("mismatch", "mismatch: max |log r|, first update", False), ("response_length", "response length", False),
          ("truncated", "truncated fraction", False)]


def _band(values: list[list], key: str, log: bool) -> list[dict]:
    """Per step, the mean and 95% t interval over the seeds (on a log axis: of the log10 values,
    so the mean is a geometric mean)."""
    if log:
        values = [[math.log10(v) if v is not None and v > 0 else None for v in vs] for vs in values]
    cells = [interval(vs, (None, None) if log else RANGES[key]) for vs in values]
    if log:
        cells = [{"mean": None if c["mean"] is None else 10 ** c["mean"],
                  "ci95": c["ci95"] and [10 ** c["ci95"][0], 10 ** c["ci95"][1]]} for c in cells]
    return cells


def plot(runs: list[dict], path: str) -> None:
    """The curves, one panel per measure. A line that stops before the last step (every seed
    without a value from there: a collapse leaves every advantage 0) ends in an ×, noted. On a
    log axis the limits follow the means (a factor 10 beyond them), so one objective's wide band
    cannot flatten the others."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by_objective = {}
    for run in runs:
        by_objective.setdefault(run["row"]["objective"], []).append(run)
    last_step = max((s for run in runs for s in run["curves"]["step"]), default=0)
    fig, axes = plt.subplots(3, 3, figsize=(15, 11))
    for ax, (key, title, log) in zip(axes.flat, PANELS):
        means = []
        for i, (name, rs) in enumerate(by_objective.items()):       # one colour per objective in every panel
            cs = [r["curves"] for r in rs]
            steps = sorted({s for c in cs for s in c["step"]})
            cells = _band([[dict(zip(c["step"], c.get(key, []))).get(s) for c in cs] for s in steps], key, log)
            points = [(s, c) for s, c in zip(steps, cells) if c["mean"] is not None]
            if not points:
                continue
            colour = f"C{i % 10}"
            xs = [s for s, _ in points]
            means += [c["mean"] for _, c in points]
            ax.plot(xs, [c["mean"] for _, c in points], color=colour, label=f"{name} ({len(cs)} seeds)")
            band = [(s, c["ci95"]) for s, c in points if c["ci95"]]
            if band:
                ax.fill_between([s for s, _ in band], [b[0] for _, b in band], [b[1] for _, b in band],
                                color=colour, alpha=0.2)
            if xs[-1] < last_step:
                gone = sum(bool(r["row"]["collapsed"]) for r in rs)
                ax.plot([xs[-1]], [points[-1][1]["mean"]], "x", color=colour, markersize=9)
                ax.annotate(f"no value after step {xs[-1]}" + (f" ({gone} of {len(rs)} collapsed)" if gone else ""),
                            (xs[-1], points[-1][1]["mean"]), textcoords="offset points", xytext=(4, 4),
                            fontsize=7, color=colour)
        ax.set_title(title + (" (geometric mean)" if log else " (mean)"), fontsize=10)
        ax.set_xlabel("step")
        positive = [m for m in means if m > 0]
        if log and positive:
            ax.set_yscale("log")
            ax.set_ylim(min(positive) / 10, max(positive) * 10)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
