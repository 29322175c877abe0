"""drpo-lab's results: each run's record summarized (final reward, reward AUC, spikes, collapse,
mismatch), the seeds aggregated into means with 95% t intervals and ranks, the markdown table and
the curves' picture."""
from __future__ import annotations

import math
import statistics


FINAL_STEPS = 5
# A run has collapsed when, over its last FINAL_STEPS steps, responses are mostly target words
# (mean target fraction >= 0.5) yet hold at most 2 distinct ones (mean reward <= 2/8): the
# policy found the targets and then narrowed onto one or two of them.
COLLAPSE_FRACTION, COLLAPSE_REWARD = 0.5, 2 / 8
RESULT_KEYS = ("objective", "params", "seed", "preset", "final_reward", "reward_auc", "max_grad_norm",
               "max_token_weight", "mismatch", "collapsed", "dead_steps", "wall_s")
SUMMARY_KEYS = ("final_reward", "reward_auc", "max_grad_norm", "max_token_weight", "mismatch")
# what each measure can be: an interval is cut to it (the mean lies inside, so the cut one still
# holds it at least as often); a reward is distinct targets / 8
RANGES = {"final_reward": (0.0, 1.0), "reward_auc": (0.0, 1.0), "reward": (0.0, 1.0), "max_grad_norm": (0.0, None),
          "grad_norm": (0.0, None), "max_token_weight": (0.0, None), "mismatch": (0.0, None)}


def collapsed(steps: list[dict]) -> bool:
    tail = steps[-FINAL_STEPS:]
    if not tail:
        return False
    fraction = statistics.mean(s.get("target_fraction", 0.0) for s in tail)
    return fraction >= COLLAPSE_FRACTION and statistics.mean(s["reward"] for s in tail) <= COLLAPSE_REWARD


def _finite(xs) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]


def _mean_or_none(xs):
    return statistics.mean(xs) if xs else None


def summarize(steps: list[dict], updates: list[dict]) -> dict:
    """A run's row from its per-step log (OpenRLHF's) and per-update log (the step log)."""
    rewards = [s["reward"] for s in steps]
    per_step = {}
    for u in updates:
        per_step.setdefault(u["step"], []).append(u)
    return {
        "final_reward": statistics.mean(rewards[-FINAL_STEPS:]) if rewards else None,
        "reward_auc": statistics.mean(rewards) if rewards else None,
        "max_grad_norm": max(_finite(u.get("grad_norm") for u in updates), default=None),
        "max_token_weight": max(_finite(u.get("max_token_weight") for u in updates), default=None),
        "mismatch": _mean_or_none(_finite(curves(steps, updates)["mismatch"])),
        "collapsed": collapsed(steps),
        "dead_steps": sum(all(u["dead"] for u in us) for us in per_step.values()),
    }


def curves(steps: list[dict], updates: list[dict]) -> dict:
    """Per step: reward, the largest grad norm and token weight over its updates, and the
    engine/trainer mismatch: max |log r| on its first update, where π is still the trainer's
    copy of the rollout policy."""
    out = {"step": [s["step"] for s in steps], "reward": [s["reward"] for s in steps]}
    by_step = {}
    for u in updates:
        by_step.setdefault(u["step"], []).append(u)
    for key in ("grad_norm", "max_token_weight"):
        out[key] = [max(_finite(u.get(key) for u in by_step.get(s, [])), default=None) for s in out["step"]]
    first = {s: us[0] for s, us in by_step.items() if us and us[0]["update"] == 0}
    out["mismatch"] = [max(abs(math.log(first[s]["ratio_max"])), abs(math.log(first[s]["ratio_min"])))
                       if s in first and "ratio_min" in first[s] else None for s in out["step"]]
    return out


def interval(xs: list[float], bounds: tuple = (None, None)) -> dict:
    """Mean and its two-sided 95% Student-t interval, mean +- t(0.975, n-1) s / sqrt(n), over the
    finite values, cut to `bounds` (the measure's range: RANGES); with one value, no interval."""
    xs = _finite(xs)
    if not xs:
        return {"mean": None, "ci95": None}
    mean = statistics.mean(xs)
    if len(xs) < 2:
        return {"mean": mean, "ci95": None}
    from scipy.stats import t
    half = float(t.ppf(0.975, len(xs) - 1)) * statistics.stdev(xs) / math.sqrt(len(xs))
    lo, hi = bounds
    return {"mean": mean, "ci95": [mean - half if lo is None else max(lo, mean - half),
                                   mean + half if hi is None else min(hi, mean + half)]}


def aggregate(rows: list[dict]) -> list[dict]:
    """One summary row per objective (in the order first seen): each measure's mean and 95% t
    interval over the seeds, and how many seeds collapsed; then `rank` by final reward."""
    groups = {}
    for r in rows:
        groups.setdefault(r["objective"], []).append(r)
    out = [{"objective": name, "params": rs[0]["params"], "preset": rs[0]["preset"], "seeds": len(rs),
            **{k: interval([r[k] for r in rs], RANGES[k]) for k in SUMMARY_KEYS},
            "collapsed": f"{sum(bool(r['collapsed']) for r in rs)} of {len(rs)}"} for name, rs in groups.items()]
    for row, rank in zip(out, ranks([r["final_reward"] for r in out])):
        row["rank"] = rank
    return out


def ranks(cells: list[dict]) -> list[int]:
    """Each objective's rank is 1 + the number of objectives whose interval lies wholly above its
    own (lower end above its upper end): two share a rank unless the intervals separate them
    from the same others. No interval: its mean alone; no mean: no rank (None)."""
    span = lambda c: c["ci95"] or [c["mean"], c["mean"]]  # noqa: E731
    return [None if c["mean"] is None else
            1 + sum(o["mean"] is not None and span(o)[0] > span(c)[1] for o in cells) for c in cells]


def _cell(c: dict) -> str:
    if c["mean"] is None:
        return "-"
    return f"{c['mean']:.3g}" + (f" [{c['ci95'][0]:.3g}, {c['ci95'][1]:.3g}]" if c["ci95"] else "")


def markdown(rows: list[dict], summary: list[dict]) -> str:
    """The summary (mean [95% t interval] over seeds, ranked) above the per-run table."""
    head = ["rank", "objective", "seeds", *SUMMARY_KEYS, "collapsed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(summary, key=lambda r: (r["rank"] is None, r["rank"] or 0, -(r["final_reward"]["mean"] or 0))):
        lines.append("| " + " | ".join([str(r["rank"]), r["objective"], str(r["seeds"]),
                                         *[_cell(r[k]) for k in SUMMARY_KEYS], r["collapsed"]]) + " |")
    cols = [k for k in RESULT_KEYS if k != "params"]
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def html_page(table: str, curves_png: bytes, title: str) -> str:
    """One self-contained page: the markdown tables (results.md) as HTML tables, the rule for
    intervals and ranks, and the curves embedded."""
    import base64
    import html
    out, rows = [], []
    for line in table.splitlines() + [""]:
        if line.startswith("|"):
            if not set(line) <= set("|-"):
                rows.append([html.escape(c.strip()) for c in line.strip("|").split("|")])
            continue
        if rows:
            out.append("<table>" + "".join(f"<tr>{''.join(f'<{t}>{c}</{t}>' for c in r)}</tr>"
                                           for r, t in zip(rows, ["th"] + ["td"] * len(rows))) + "</table>")
            rows = []
    rule = ("Mean [95% Student-t interval] over the seeds, cut to what the measure can be; an objective's rank is "
            "1 + the number of objectives whose final-reward interval lies wholly above its own.")
    png = base64.b64encode(curves_png).decode("ascii")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title><style>"
            "body{font-family:sans-serif} table{border-collapse:collapse;margin:1em 0} "
            "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p>{rule}</p>{out[0] if out else ''}"
            f'<img alt="reward, grad norm, token weight and mismatch per step" src="data:image/png;base64,{png}"/>'
            f"<h2>Every run</h2>{''.join(out[1:])}</body></html>\n")


def plot(runs: list[dict], path: str) -> None:
    """Per objective, the mean over seeds at each step and its 95% t band (on log axes, of the
    log values)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("reward", "reward (distinct targets / 8)", False), ("grad_norm", "grad norm before clipping (max)", True),
              ("max_token_weight", "max |∂ℓ/∂log π| / |A| (per step)", True),
              ("mismatch", "engine/trainer mismatch: max |log r|, first update", False)]
    by_objective = {}
    for run in runs:
        by_objective.setdefault(run["row"]["objective"], []).append(run["curves"])
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, title, log) in zip(axes.flat, panels):
        for i, (name, cs) in enumerate(by_objective.items()):       # one colour per objective in every panel
            steps = sorted({s for c in cs for s in c["step"]})
            values = [[dict(zip(c["step"], c[key])).get(s) for c in cs] for s in steps]
            if log:     # a log axis: the interval of log10 values, so the mean is a geometric mean
                values = [[math.log10(v) if v is not None and v > 0 else None for v in vs] for vs in values]
            cells = [interval(vs, (None, None) if log else RANGES[key]) for vs in values]
            if log:
                cells = [{"mean": None if c["mean"] is None else 10 ** c["mean"],
                          "ci95": c["ci95"] and [10 ** c["ci95"][0], 10 ** c["ci95"][1]]} for c in cells]
            points = [(s, c) for s, c in zip(steps, cells) if c["mean"] is not None]
            if not points:
                continue
            xs = [s for s, _ in points]
            ax.plot(xs, [c["mean"] for _, c in points], color=f"C{i % 10}", label=f"{name} ({len(cs)} seeds)")
            band = [(s, c["ci95"]) for s, c in points if c["ci95"]]
            if band:
                ax.fill_between([s for s, _ in band], [b[0] for _, b in band], [b[1] for _, b in band],
                                color=f"C{i % 10}", alpha=0.2)
        ax.set_title(title + (" (geometric mean)" if log else " (mean)"), fontsize=10)
        ax.set_xlabel("step")
        if log and ax.has_data():
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
