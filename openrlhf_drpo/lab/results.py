"""drpo-lab's results: each run's record summarized (final reward, reward AUC, spikes, collapse,
mismatch, entropy and its drift, the fraction past the boundary, the ratios' ESS, response
length and truncation), the seeds aggregated into means with 95% t intervals, the ranks, and the
results' page (markdown and HTML)."""
from __future__ import annotations

import math
import statistics


FINAL_STEPS = 5
# A run has collapsed when, over its last FINAL_STEPS steps, responses are mostly target words
# (mean target fraction >= 0.5) yet hold at most 2 distinct ones (mean reward <= 2/8): the
# policy found the targets and then narrowed onto one or two of them.
COLLAPSE_FRACTION, COLLAPSE_REWARD = 0.5, 2 / 8
RESULT_KEYS = ("objective", "params", "seed", "preset", "final_reward", "reward_auc", "max_grad_norm",
               "max_abs_wr", "mismatch", "entropy_drift", "final_entropy", "past_boundary", "ess",
               "response_length", "truncated", "collapsed", "dead_steps", "wall_s")
SUMMARY_KEYS = ("final_reward", "reward_auc", "max_grad_norm", "max_abs_wr", "mismatch", "entropy_drift",
                "final_entropy", "past_boundary", "ess", "response_length", "truncated")
# what each measure can be: an interval is cut to it (the mean lies inside, so the cut one still
# holds it at least as often); a reward is distinct targets / 8
RANGES = {"final_reward": (0.0, 1.0), "reward_auc": (0.0, 1.0), "reward": (0.0, 1.0), "max_grad_norm": (0.0, None),
          "grad_norm": (0.0, None), "max_abs_wr": (0.0, None), "mismatch": (0.0, None), "entropy_drift": (None, None),
          "final_entropy": (0.0, None), "entropy": (0.0, None), "past_boundary": (0.0, 1.0), "ess": (0.0, 1.0),
          "response_length": (0.0, None), "truncated": (0.0, 1.0)}
# the tables' column names (results.json keeps the keys): the measured |∂ℓ/∂log π|/|A| is |w·r|,
# which is not the predicted "w range"
HEADERS = {"final_reward": "final reward", "reward_auc": "reward AUC", "max_grad_norm": "max grad norm",
           "max_abs_wr": "max |w·r|", "entropy_drift": "entropy drift", "final_entropy": "final entropy",
           "past_boundary": "past boundary", "ess": "ESS", "response_length": "response length",
           "dead_steps": "dead steps", "wall_s": "wall s"}
# What ranks the objectives: the final reward, highest first; under random-reward (whose reward
# carries no signal) the entropy's drift, closest to 0 first: an unbiased objective's is 0.
RANK_BY = {"random-reward": ("entropy_drift", "|entropy drift|, smallest first")}
DEFAULT_RANK = ("final_reward", "final reward, highest first")
DEFINITIONS = (
    "final reward: mean of the last 5 steps; reward AUC: mean over all steps; max grad norm: before clipping, "
    "over every update; max |w·r|: the largest per-token |∂ℓ/∂log π|/|A| (the measured weight times r, not the "
    "predicted w); mismatch: mean over steps of max |log r| on each step's first update; entropy: the policy's "
    "mean token entropy on the step's responses (OpenRLHF's entropy_loss, averaged over the step's updates); "
    "final entropy: mean of the last 5 steps; entropy drift: final entropy minus the first step's; past "
    "boundary: the fraction of the "
    "step's tokens past the objective's boundary (clipped, masked or filtered: w ≤ 0 where A ≠ 0), mean over "
    "steps; ESS: the ratios' normalized effective sample size (Σr)²/(n·Σr²) over an update's n tokens, the "
    "smallest of each step's updates, mean over steps; response length: tokens, mean over steps; truncated: "
    "the fraction of responses cut at the length limit, mean over steps.")


def collapsed(steps: list[dict]) -> bool:
    tail = steps[-FINAL_STEPS:]
    if not tail:
        return False
    fraction = statistics.mean(s.get("target_fraction", 0.0) for s in tail)
    return fraction >= COLLAPSE_FRACTION and statistics.mean(s["reward"] for s in tail) <= COLLAPSE_REWARD


def _finite(xs) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]


def _mean_or_none(xs):
    xs = _finite(xs)
    return statistics.mean(xs) if xs else None


def ess(ratio_sum: float, ratio_sq_sum: float, n: int) -> float | None:
    """The ratios' normalized effective sample size, (Σr)²/(n·Σr²), in (0, 1]: 1 when every r is
    equal (on-policy), 1/n when one token holds all the weight."""
    return ratio_sum ** 2 / (n * ratio_sq_sum) if n and ratio_sq_sum > 0 else None


def drift(values: list) -> float | None:
    """The entropy's drift: the mean of the last FINAL_STEPS steps minus the first step's, over
    the finite values. (A fitted line's change understated a collapse: one that falls from 3.7
    to 0 in the first 6 of 20 steps and stays there fits a line that drops 1.9.) None with
    fewer than 2 values."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if len(xs) < 2:
        return None
    return statistics.mean(xs[1:][-FINAL_STEPS:]) - xs[0]


def summarize(steps: list[dict], updates: list[dict]) -> dict:
    """A run's row from its per-step log (OpenRLHF's) and per-update log (the step log)."""
    rewards = [s["reward"] for s in steps]
    per_step = {}
    for u in updates:
        per_step.setdefault(u["step"], []).append(u)
    c = curves(steps, updates)
    return {
        "final_reward": statistics.mean(rewards[-FINAL_STEPS:]) if rewards else None,
        "reward_auc": statistics.mean(rewards) if rewards else None,
        "max_grad_norm": max(_finite(u.get("grad_norm") for u in updates), default=None),
        "max_abs_wr": max(_finite(u.get("max_token_weight") for u in updates), default=None),
        "mismatch": _mean_or_none(c["mismatch"]),
        "entropy_drift": drift(c["entropy"]),
        "final_entropy": _mean_or_none(c["entropy"][-FINAL_STEPS:]),
        **{k: _mean_or_none(c[k]) for k in ("past_boundary", "ess", "response_length", "truncated")},
        "collapsed": collapsed(steps),
        "dead_steps": sum(all(u["dead"] for u in us) for us in per_step.values()),
    }


def curves(steps: list[dict], updates: list[dict]) -> dict:
    """Per step: reward; the largest grad norm and |w·r| over its updates; the engine/trainer
    mismatch, max |log r| on its first update, where π is still the trainer's copy of the rollout
    policy; the entropy, response length and truncated fraction (OpenRLHF's); the fraction past
    the boundary over all its updates' tokens; and the smallest ESS of its updates."""
    out = {"step": [s["step"] for s in steps], "reward": [s["reward"] for s in steps]}
    for key, logged in (("entropy", "entropy_loss"), ("response_length", "rollout/response_length_mean"),
                        ("truncated", "rollout/truncated_rate")):
        out[key] = [s.get(logged) for s in steps]
    by_step = {}
    for u in updates:
        by_step.setdefault(u["step"], []).append(u)
    for key, logged in (("grad_norm", "grad_norm"), ("max_abs_wr", "max_token_weight")):
        out[key] = [max(_finite(u.get(logged) for u in by_step.get(s, [])), default=None) for s in out["step"]]
    first = {s: us[0] for s, us in by_step.items() if us and us[0]["update"] == 0}
    out["mismatch"] = [max(abs(math.log(first[s]["ratio_max"])), abs(math.log(first[s]["ratio_min"])))
                       if s in first and "ratio_min" in first[s] else None for s in out["step"]]
    out["past_boundary"], out["ess"] = [], []
    for s in out["step"]:
        us = [u for u in by_step.get(s, []) if u.get("tokens")]
        tokens = sum(u["tokens"] for u in us)
        out["past_boundary"].append(sum(u["past_boundary"] for u in us) / tokens if tokens else None)
        out["ess"].append(min(_finite(ess(u["ratio_sum"], u["ratio_sq_sum"], u["tokens"]) for u in us), default=None))
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


def rank_rule(preset: str) -> str:
    key, order = RANK_BY.get(preset, DEFAULT_RANK)
    return (f"rank: by the mean {order} (equal means share a rank); \"(=k,...)\" lists the ranks whose 95% "
            f"interval of {HEADERS.get(key, key)} overlaps this one's: the intervals do not separate them")


def aggregate(rows: list[dict]) -> list[dict]:
    """One summary row per objective (in the order first seen): each measure's mean and 95% t
    interval over the seeds, and how many seeds collapsed; then `rank` and `tied_with` (rank_rule)."""
    groups = {}
    for r in rows:
        groups.setdefault(r["objective"], []).append(r)
    out = [{"objective": name, "params": rs[0]["params"], "preset": rs[0]["preset"], "seeds": len(rs),
            **{k: interval([r.get(k) for r in rs], RANGES[k]) for k in SUMMARY_KEYS},
            "collapsed": f"{sum(bool(r['collapsed']) for r in rs)} of {len(rs)}"} for name, rs in groups.items()]
    key, _ = RANK_BY.get(out[0]["preset"] if out else "", DEFAULT_RANK)
    closest = key != "final_reward"
    for row, (rank, tied) in zip(out, ranks([r[key] for r in out], closest_to_zero=closest)):
        row["rank"], row["tied_with"] = rank, [out[i]["objective"] for i in tied]
    return out


def ranks(cells: list[dict], closest_to_zero: bool = False) -> list[tuple]:
    """(rank, tied) per cell: the rank by mean, highest first (or |mean| smallest first), equal
    means sharing one; `tied`, the indices of the other cells whose interval overlaps this one's
    (closed intervals; no interval: the mean alone). No mean: (None, [])."""
    score = (lambda m: -abs(m)) if closest_to_zero else (lambda m: m)  # noqa: E731
    span = lambda c: c["ci95"] or [c["mean"], c["mean"]]  # noqa: E731
    out = []
    for i, c in enumerate(cells):
        if c["mean"] is None:
            out.append((None, []))
            continue
        above = sum(o["mean"] is not None and score(o["mean"]) > score(c["mean"]) for o in cells)
        tied = [j for j, o in enumerate(cells) if j != i and o["mean"] is not None
                and span(o)[0] <= span(c)[1] and span(c)[0] <= span(o)[1]]
        out.append((1 + above, tied))
    return out


def rank_cell(row: dict, summary: list[dict]) -> str:
    """'2 (=1,3)': rank 2, not separated from ranks 1 and 3."""
    if row["rank"] is None:
        return "-"
    by_name = {r["objective"]: r["rank"] for r in summary}
    tied = sorted({by_name[o] for o in row["tied_with"]})
    return str(row["rank"]) + (f" (={','.join(map(str, tied))})" if tied else "")


def _cell(c: dict) -> str:
    if c["mean"] is None:
        return "-"
    return f"{c['mean']:.3g}" + (f" [{c['ci95'][0]:.3g}, {c['ci95'][1]:.3g}]" if c["ci95"] else "")


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    cells = lambda r: [str(c).replace("|", "\\|") for c in r]  # noqa: E731   (|w·r| in a markdown cell)
    return ["| " + " | ".join(cells(head)) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(cells(r)) + " |" for r in rows]


def summary_table(summary: list[dict]) -> str:
    """The summary (mean [95% t interval] over seeds), in rank order."""
    head = ["rank", "objective", "seeds", *[HEADERS.get(k, k) for k in SUMMARY_KEYS], "collapsed"]
    ordered = sorted(summary, key=lambda r: (r["rank"] is None, r["rank"] or 0))
    return "\n".join(_table(head, [[rank_cell(r, summary), r["objective"], r["seeds"],
                                    *[_cell(r[k]) for k in SUMMARY_KEYS], r["collapsed"]] for r in ordered])) + "\n"


def runs_table(rows: list[dict]) -> str:
    cols = [k for k in RESULT_KEYS if k not in ("params", "preset")]
    fmt = lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    return "\n".join(_table([HEADERS.get(c, c) for c in cols], [[fmt(r[c]) for c in cols] for r in rows])) + "\n"


def markdown(rows: list[dict], summary: list[dict], title: str = "drpo-lab", setting: str = "",
             predicted: tuple | None = None) -> str:
    """results.md: the title and setting, the ranked summary with its rule and the definitions,
    the curves, the predicted table (drpo-analyze's, `predicted` = (head, rows)) and every run."""
    preset = summary[0]["preset"] if summary else ""
    parts = [f"# {title}", setting, "## Measured",
             f"Mean [95% Student-t interval] over the seeds, cut to what the measure can be. "
             f"{rank_rule(preset).replace('rank:', 'Rank:', 1)}.",
             summary_table(summary).rstrip("\n"), DEFINITIONS, "![the curves: each objective's mean over seeds, "
             "with its 95% t band](curves.png)"]
    if predicted:
        parts += ["## Predicted (drpo-analyze)", "\n".join(_table(*predicted))]
    parts += ["## Every run", runs_table(rows).rstrip("\n")]
    return "\n\n".join(p for p in parts if p) + "\n"


def html_page(page: str, curves_png: bytes) -> str:
    """results.md as one self-contained page: headings, paragraphs and tables as HTML, the
    curves embedded where results.md shows curves.png."""
    import base64
    import html
    import re
    png = base64.b64encode(curves_png).decode("ascii")
    title, out = "drpo-lab", []
    for block in page.split("\n\n"):
        lines = block.strip("\n").splitlines()
        if not lines:
            continue
        if lines[0].startswith("|"):
            rows = [[html.escape(c.strip().replace("\\|", "|")) for c in re.split(r"(?<!\\)\|", x.strip())[1:-1]]
                    for x in lines if not set(x) <= set("|-")]
            out.append("<table>" + "".join(f"<tr>{''.join(f'<{t}>{c}</{t}>' for c in r)}</tr>"
                                           for r, t in zip(rows, ["th"] + ["td"] * len(rows))) + "</table>")
        elif m := re.match(r"!\[(.*)\]\(curves\.png\)$", block.strip()):
            out.append(f'<img alt="{html.escape(m.group(1))}" src="data:image/png;base64,{png}"/>')
        elif block.startswith("#"):
            level = len(block) - len(block.lstrip("#"))
            text = block.lstrip("#").strip()
            title = text if level == 1 else title
            out.append(f"<h{level}>{html.escape(text)}</h{level}>")
        else:
            out.append(f"<p>{html.escape(block.strip())}</p>")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title><style>"
            "body{font-family:sans-serif} table{border-collapse:collapse;margin:1em 0} "
            "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}</style></head><body>"
            + "".join(out) + "</body></html>\n")
