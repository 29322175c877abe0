"""The situations that change an objective's gradient, derived from its structure: a walk of the
IR that reads each operation's declared properties (a reduction's `over` and `reduce`, a
condition's `args_kind`) and the built-ins it names, never a list of objectives. Each scenario is
a held point for analysis.batch.view (a group's advantages, |y|, the position, a held staleness), named
in a researcher's words; its claim is w = (∂ℓ/∂r)/A there, sampled by the IR's float rules and
compared with the analysed point's (analysis.batch.scenario_check holds it to the compiled loss)."""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from dsl.errors import DslError
from dsl.ir import Node
from dsl.objective import Objective
from dsl.operations import OPS
from dsl.printing import render
from dsl.walks import derivative, numpy_plan
from openrlhf_drpo.analysis.batch.held import GROUP_SIZE
from openrlhf_drpo.analysis.mathtext import fmt
from openrlhf_drpo.analysis.batch.view import analysis_view

LONG = 1024          # |y| of a long response
CUT = 4096           # |y| of a response cut at the length limit, where seq_len is read
STALE = 16           # policy versions of a stale sample
PREFIX_LEN = 64      # the response a prefix's first and last tokens are read on
# where w is sampled: ratios around r = 1 and every half decade out to 1e±12 (π ≤ 1), μ from rare to
# certain tokens, |A| from tiny to huge
RATIOS = (0.3, 0.7, 0.9, 0.99, 1.0, 1.01, 1.1, 1.3, 3.0)
DECADES = (-12, 12, 49)
MUS = (1e-6, 1e-3, 0.01, 0.2, 0.5, 1.0)
MAGNITUDES = (1e-3, 0.5, 1.0, 3.0, 1e3)
RTOL = 1e-9


@dataclass(frozen=True)
class Scenario:
    """A situation: its name on the command line, its words, the construct it comes from, and the
    held point it sets (analysis.batch.view.analysis_view's keywords, over the analysed point's)."""
    name: str
    title: str
    construct: str
    point: dict = field(default_factory=dict, hash=False, compare=False)


def _constructs(obj: Objective) -> dict:
    """What the objective's IR holds that a situation decides: the reductions by what they reduce
    over (group and batch ones split by whether their argument reads A, order statistics apart), the
    built-ins seq_len, turn_len and staleness, and the indicators (operations whose argument is a
    condition)."""
    found = {"group": False, "group_of_a": False, "batch_of_a": False, "order_of_a": [], "response": False,
             "prefix": False, "turn": False, "seq_len": False, "staleness": False, "indicators": []}
    for n in obj.expr.walk():
        op = OPS.get(n.op)
        if n.op == "var" and n.value in ("seq_len", "turn_len", "staleness"):
            found["seq_len" if n.value != "staleness" else "staleness"] = True
        if op is None:
            continue
        if op.args_kind == "bool" and op.kind == "num":
            found["indicators"].append(n)
        if not op.reduce:
            continue
        if op.over in ("response", "prefix", "turn"):
            found[op.over] = True
        if op.over == "group":
            found["group"] = True
        if op.over in ("group", "batch") and any(m.op == "var" and m.value == "A" for m in n.args[0].walk()):
            found[f"{op.over}_of_a"] = True
            if op.reduce in ("max", "min"):
                found["order_of_a"].append(n)
    found["indicators"] = list(dict.fromkeys(found["indicators"]))
    return found


def derive(obj: Objective, point: dict | None = None) -> list[Scenario]:
    """The scenarios of obj, each a held point over `point` (the analysed one: group_size, group,
    batch_size, position, seq_len, held), in the order a reader meets them: the group, its order
    statistics, the response, the prefix, staleness. None for a token-level objective."""
    point = point or {}
    c = _constructs(obj)
    G = max(len(point["group"]) if point.get("group") else point.get("group_size") or GROUP_SIZE, 3)
    seq = point.get("seq_len", 1)
    out = []
    if c["group_of_a"] or c["batch_of_a"]:
        out += [Scenario("zero-variance", "a zero-variance group (all right or all wrong)", "group",
                         {"group": (1,) * G}),
                Scenario("one-success", f"one success in G = {G} (the token's; for A < 0 the one failure)",
                         "group", {"group": (1,) + (0,) * (G - 1)}),
                Scenario("one-failure", f"one failure in G = {G} (the token's among the right; for A < 0 "
                         "among the wrong)", "group", {"group": (1,) * (G - 1) + (0,)})]
    if c["group"] or c["group_of_a"] or c["batch_of_a"]:
        out.append(Scenario("group-of-one", "a group of one response (G = 1)", "group", {"group": (1,)}))
    if c["order_of_a"]:
        which = " and ".join(dict.fromkeys(n.op for n in c["order_of_a"]))
        out += [Scenario("attains", f"the token's response alone attains the group's {which}", "order statistic",
                         {"group": (1, Fraction(1, 2)) + (0,) * (G - 2)}),
                Scenario("not-attaining", f"another response attains the group's {which}", "order statistic",
                         {"group": (1, 2) + (0,) * (G - 2)}),
                Scenario("tie", f"a tie at the group's {which} (the token's response and another)",
                         "order statistic", {"group": (1, 1) + (0,) * (G - 2)})]
    if c["response"] or c["turn"] or c["seq_len"]:
        out += [Scenario("one-token", "a response of one token", "sequence", {"seq_len": 1, "position": 1}),
                Scenario("long-response", f"a long response (|y| = {LONG})", "sequence",
                         {"seq_len": LONG, "position": LONG})]
    if c["seq_len"]:
        out.append(Scenario("truncated", f"a response cut at the length limit (|y| = {CUT})", "sequence",
                            {"seq_len": CUT, "position": CUT}))
    if c["prefix"]:
        length = max(seq, PREFIX_LEN)
        out += [Scenario("first-token", f"the first token of a response of {length}", "prefix",
                         {"seq_len": length, "position": 1}),
                Scenario("last-token", f"the last token of a response of {length}", "prefix",
                         {"seq_len": length, "position": length})]
    if c["staleness"]:
        out += [Scenario("fresh", "a fresh sample (staleness 0)", "staleness", {"held": {"staleness": 0}}),
                Scenario("stale", f"a stale sample (staleness {STALE} policy versions)", "staleness",
                         {"held": {"staleness": STALE}})]
    return out


def at(point: dict, scenario: Scenario) -> dict:
    """The analysed point with the scenario's held values over it (a group sets G and N = G)."""
    out = {**point, **{k: v for k, v in scenario.point.items() if k != "held"}}
    out["held"] = {**(point.get("held") or {}), **scenario.point.get("held", {})}
    if "group" in scenario.point:
        out["group_size"], out["batch_size"] = None, None
    if "seq_len" in scenario.point and out.get("position") and out["position"] > out["seq_len"]:
        out["position"] = out["seq_len"]
    return out


def replaced(point: dict, scenario: Scenario) -> list[str]:
    """The settings given in `point` that analysing at `scenario` (at) would replace: refused by name by
    --scenario, never dropped (seq_len 1 and group_size are the defaults: a group scenario's G is group_size's)."""
    sets, held = scenario.point, point.get("held") or {}
    out = [f"--{k.replace('_', '-')}" for k in ("group", "batch_size") if "group" in sets and point.get(k) is not None]
    out += [f"--{k.replace('_', '-')} {point[k]}" for k in ("seq_len", "position") if k in sets
            and point.get(k) not in (None, sets[k]) and not (k == "seq_len" and point[k] == 1)]
    return out + [f"--set {k}={v}" for k, v in held.items() if k in sets.get("held", {}) and sets["held"][k] != v]


def find(obj: Objective, name: str, point: dict | None = None) -> Scenario:
    """The scenario called `name`, or a ValueError that lists obj's."""
    found = {s.name: s for s in derive(obj, point)}
    if name not in found:
        have = ", ".join(found) or "none: it reads no group, batch, response, prefix, turn or staleness"
        raise ValueError(f"objective '{obj.name}' has no scenario '{name}' (its scenarios: {have})")
    return found[name]


# ------------------------------------------------------------------ sampling w at a held point
def _grid():
    import numpy as np
    ratios = np.unique(np.concatenate([RATIOS, np.logspace(*DECADES)]))
    r, mu, mag, sign = (np.array(x, dtype=float).ravel() for x in np.meshgrid(
        ratios, MUS, MAGNITUDES, (1.0, -1.0), indexing="ij"))
    keep = r * mu <= 1
    return r[keep], mu[keep], sign[keep] * mag[keep]


def view_at(obj: Objective, rho: float, point: dict, said=True):
    """analysis.batch.view's objective at `point` (its keywords), with its parameters' values."""
    kw = {k: point.get(k) for k in ("group_size", "batch_size", "position", "group")}
    held = point.get("held") or None
    view, scope = analysis_view(obj, point.get("seq_len", 1), rho, **kw, held=held, said=said)
    return view, scope


def sample(view: Objective, expr: Node | None = None, hat=None) -> dict:
    """w = (∂ℓ/∂r)/A on the sampling grid by the IR's float rules (nan where ℓ or w is not a finite
    double), with (r, μ, A); `expr` another expression of the view (an indicator's value instead);
    `hat` the objective's own advantage Â's values on the grid: w = (∂ℓ/∂r)/Â, 0 where Â = 0."""
    import numpy as np
    r, mu, A = _grid()
    env = {**{k: float(v) for k, v in view.params.items()}, "r": r, "mu": mu, "pi": mu * r, "A": A}
    if expr is not None:
        (value,) = numpy_plan(expr)(env)
        return {"value": np.broadcast_to(np.asarray(value, dtype=float), r.shape), "r": r, "mu": mu, "A": A}
    ell, dl = numpy_plan(view.expr, derivative(view.expr))(env)
    with np.errstate(all="ignore"):
        if hat is None:
            w = np.broadcast_to(dl, r.shape) / A
        else:       # no Â, no gradient: the no-gradient scenario (a zero-variance group) says so
            dl = np.broadcast_to(dl, r.shape)
            w = np.where((hat == 0) & (dl == 0), 0.0, dl / np.where(hat == 0, np.nan, hat))
        ok = np.isfinite(np.broadcast_to(ell, r.shape)) & np.isfinite(w)
    return {"w": np.where(ok, w, np.nan), "r": r, "mu": mu, "A": A}


def indicator_view(obj: Objective, ind: Node, rho: float, point: dict):
    """An indicator of obj as an objective of its own, viewed at `point`: its value there."""
    alone = Objective(obj.name, obj.path, obj.source, ind, dict(obj.params), dict(obj.options), {}, obj.description)
    obj.facts.part(ind)     # its levels are the objective's: not computed again per indicator and scenario
    reads = {"staleness": "staleness", "H": "H", "rho_ref": "pi_ref"}
    held = {k: v for k, v in (point.get("held") or {}).items() if reads.get(k) in alone.names()}
    return view_at(alone, rho, {**point, "held": held}, said=False)[0]


# ------------------------------------------------------------------ each scenario's claim
_SIGN = {"positive": 1.0, "negative": -1.0}
_WORDS = {"positive": "A > 0", "negative": "A < 0"}


def _same(a, b):
    import numpy as np
    both = np.isfinite(a) & np.isfinite(b)
    close = np.abs(a - b) <= RTOL * np.fmax(np.abs(a), np.abs(b)) + 1e-300
    return bool(np.all(np.isnan(a) == np.isnan(b)) and np.all(close[both]))


def _side(s: dict, base: dict, sign: float) -> dict:
    """One sign of A's facts: w at the sample points, its on-policy span, how it stands to the base's."""
    import numpy as np
    m = np.sign(s["A"]) == sign
    w, wb = s["w"][m], base["w"][m]
    finite = w[np.isfinite(w)]
    on = w[(s["r"][m] == 1.0) & np.isfinite(w)]
    state = ("undefined" if np.isnan(w).any() and not np.isnan(wb).all() and np.isnan(w).sum() > np.isnan(wb).sum()
             else "no gradient" if finite.size and np.all(finite == 0) and not np.all(wb[np.isfinite(wb)] == 0)
             else "same" if _same(w, wb) else "differs")
    out = {"state": state, "on_policy": [float(on.min()) + 0.0, float(on.max()) + 0.0] if on.size else None,
           "undefined": int(np.isnan(w).sum()), "points": int(w.size)}
    if state == "differs":      # the most ordinary point where they differ: r, |A| nearest 1, μ mid
        bad = ~((np.abs(w - wb) <= RTOL * np.fmax(np.abs(w), np.abs(wb))) | (np.isnan(w) & np.isnan(wb)))
        plain = np.abs(np.log(s["r"][m])) + np.abs(np.log(np.abs(s["A"][m]))) + np.abs(np.log(s["mu"][m] / 0.2))
        k = int(np.argmin(np.where(bad, plain, np.inf)))
        out["witness"] = {"r": float(s["r"][m][k]), "mu": float(s["mu"][m][k]), "A": float(s["A"][m][k]),
                          "w": _float(w[k]), "w_analysed": _float(wb[k])}
    return out


def _float(x):
    import math
    return None if math.isnan(x) else float(x) + 0.0     # (+ 0.0: no −0)


def _on_policy(side) -> str:
    lo, hi = side["on_policy"] or (None, None)
    return "undefined" if lo is None else fmt(lo) if fmt(lo) == fmt(hi) else f"from {fmt(lo)} to {fmt(hi)}"


def claim(s: dict, base: dict, off: list[str], on: list[str] = ()) -> dict:
    """The scenario's claim against the analysed point's (both sampled by sample()): per sign of A
    'no gradient' (w = 0 at every point, where the analysed point has some w ≠ 0), 'undefined' (ℓ or
    w not a finite double at more points), 'same' or 'differs', with its one line. `off`: the
    indicators that are 0 at every sample point here and not at the analysed point; `on`: 1 here
    and 0 at every sample point there."""
    sides = {adv: _side(s, base, sign) for adv, sign in _SIGN.items()}
    states = {v["state"] for v in sides.values()}
    because = f", the filter {' and '.join(off)} is 0" if off else ""
    if states == {"no gradient"}:
        text = "no gradient" + because
    elif states == {"same"}:
        text = "as analysed above"
    else:
        parts = []
        for adv, v in sides.items():
            if v["state"] == "no gradient":
                parts.append(f"no gradient for {_WORDS[adv]}" + because)
            elif v["state"] == "undefined":
                parts.append(f"for {_WORDS[adv]} the loss is not a finite number (w undefined at {v['undefined']} "
                             f"of {v['points']} points)")
            elif v["state"] == "differs":
                x, was = v["witness"], _on_policy(_side(base, base, _SIGN[adv]))
                parts.append(f"for {_WORDS[adv]} w on policy {_on_policy(v)} (analysed: {was})" if v["on_policy"]
                             and _on_policy(v) != was else
                             f"for {_WORDS[adv]} w = {_shown(x['w'])} at r = {x['r']:g}, μ = {x['mu']:g}, "
                             f"|A| = {abs(x['A']):g} (analysed: {_shown(x['w_analysed'])})")
        if len(parts) == 2 and parts[0].replace("A > 0", "A < 0") == parts[1]:
            head, _, was = parts[0].replace("for A > 0 ", "").partition(" (analysed: ")
            parts = [f"{head} for both signs of A" + (f" (analysed: {was}" if was else "")]
        text = "; ".join(parts) + (f" (the filter {' and '.join(on)} is 1 here)" if on else "")
    return {"states": {k: v["state"] for k, v in sides.items()}, "sides": sides, "off": off,
            "changes": states != {"same"}, "text": text}


def _shown(x):
    return "undefined" if x is None else fmt(x)


def indicators(obj: Objective, rho: float, points: list[dict]) -> list[dict]:
    """Each indicator of obj at every point (the analysed one first, then each scenario's): its value
    on the sampling grid there, and whether it is 1 everywhere (always on), 0 everywhere (dead) or
    switches; per point, whether it is 0 at every sample (off there)."""
    import numpy as np
    out = []
    for ind in _constructs(obj)["indicators"]:
        offs, ons, values = [], [], []
        for p in points:
            view = indicator_view(obj, ind, rho, p)
            x = sample(view, view.expr)["value"]
            x = x[np.isfinite(x)]
            values.append(x)
            offs.append(bool(x.size) and bool(np.all(x == 0)))
            ons.append(bool(x.size) and bool(np.all(x == 1)))
        every = np.concatenate(values) if values else np.array([])
        state = ("always on" if every.size and np.all(every == 1) else "dead" if every.size and np.all(every == 0)
                 else "switches")
        if _per_token(ind):     # its thresholds in r, π, μ or A are the trust region's: the arbiter samples them
            state = "with the token"
        elif state != "switches" and _held_only(ind, obj.options["anchor"]):
            state = f"{state} at the held point only"
        out.append({"indicator": render(ind), "state": state, "off": offs, "all_on": ons})
    return out


def _per_token(ind: Node) -> bool:
    """Whether the indicator reads the token's own r, π, μ or A (outside a group or batch reduction):
    where it switches is a boundary of the token analysis, whose grid samples both sides of every
    threshold; this grid does not (a band 0.3 < μ < 0.31 falls between its points)."""
    stack = [ind]
    while stack:
        n = stack.pop()
        if n.op == "var" and n.value in ("r", "pi", "mu", "A", "pi_old", "pi_rollout", "pi_ref", "H", "sum_pi_sq"):
            return True
        if not (n.op in OPS and OPS[n.op].reduce and OPS[n.op].over in ("group", "batch")):
            stack.extend(n.args)
    return False


def _held_only(ind: Node, anchor: str) -> bool:
    """Whether the indicator reads what neither the grid nor the scenarios vary: a held input (the
    other policy through ρ, π_ref, H, Σπ²), or a statistic (a reduction other than a count) of a value
    besides A, which on the uniform batch ties with it (H ≥ batch_quantile(H, 0.8) holds everywhere
    there, on a fifth of a real batch's tokens). A constant value there is the held point's."""
    varied = {"r", "pi", "mu", "A", "seq_len", "turn_len", "staleness", f"pi_{anchor}"}
    return any((n.op == "var" and n.value not in varied) or (
        n.op in OPS and OPS[n.op].reduce and OPS[n.op].reduce != "count"
        and any(m.op == "var" and m.value != "A" for m in n.args[0].walk())) for n in ind.walk())


def scenario_claims(obj: Objective, rho: float, point: dict, scenarios: list[Scenario], hat: Node | None = None) -> dict:
    """Every scenario's claim and the indicators' constancy, as the analysis result holds them;
    w against the objective's own advantage `hat` (Â's node, analysis.batch.advantage) where it has one."""
    def hat_at(p):     # Â's values on the grid at the held point p (None: w against the host's A)
        if hat is None:
            return None
        view = indicator_view(obj, hat, rho, p)
        return sample(view, view.expr)["value"]
    base_view, _ = view_at(obj, rho, point)
    base = sample(base_view, hat=hat_at(point))
    points = [at(point, s) for s in scenarios]
    views, refused = [], {}
    for s, p in zip(scenarios, points):      # a held point the analysis refuses is said, not dropped
        try:
            views.append(view_at(obj, rho, p))
        except DslError as e:
            refused[s.name] = e.message
    kept = [(s, p) for s, p in zip(scenarios, points) if s.name not in refused]
    inds = indicators(obj, rho, [point] + [p for _, p in kept])
    out = [{"name": s.name, "title": s.title, "construct": s.construct, "point": _jsonable(p), "exact": None,
            "states": {}, "sides": {}, "off": [], "changes": True, "text": f"not analysed: {refused[s.name]}"}
           for s, p in zip(scenarios, points) if s.name in refused]
    for i, ((s, p), (view, scope)) in enumerate(zip(kept, views)):
        off = [d["indicator"] for d in inds if d["off"][i + 1] and not d["off"][0]]
        on = [d["indicator"] for d in inds if d["all_on"][i + 1] and d["off"][0]]
        c = claim(sample(view, hat=hat_at(p)), base, off, on)
        out.append({"name": s.name, "title": s.title, "construct": s.construct, "point": _jsonable(p),
                    "exact": scope.get("exact"), **c})
    order = [s.name for s in scenarios]
    out.sort(key=lambda d: order.index(d["name"]))
    return {"scenarios": out, "indicators": [{k: d[k] for k in ("indicator", "state")} for d in inds],
            "sampled": {"r": [10.0 ** DECADES[0], 10.0 ** DECADES[1]], "mu": [MUS[0], MUS[-1]],
                        "magnitudes": [MAGNITUDES[0], MAGNITUDES[-1]], "points": int(base["r"].size)}}


def _jsonable(p: dict) -> dict:
    out = {}
    for k, v in p.items():
        if v is None or (k == "held" and not v):
            continue
        out[k] = ([float(x) for x in v] if k == "group" else {a: float(b) for a, b in v.items()} if k == "held"
                  else v)
    return out


def scenario_analysis(obj: Objective, rho: float, point: dict, check_loss: bool = False,
                      hat: Node | None = None) -> dict | None:
    """The result's `scenarios` field: each scenario's claim, the indicators' constancy, and each
    claim held to the compiled loss (analysis.batch.scenario_check) where `check_loss`, else 'not run'.
    None where obj has neither a scenario nor an indicator."""
    scenarios = derive(obj, point)
    if not scenarios and not _constructs(obj)["indicators"]:
        return None
    out = scenario_claims(obj, rho, point, scenarios, hat)
    if not check_loss:
        checks = [{"status": "not run", "why": "it imports torch: drpo-analyze --check-loss, or "
                                              "analyze(..., check_loss=True)"}] * len(scenarios)
    else:
        from openrlhf_drpo.analysis.batch.scenario_check import check, weight_at
        names = [s["name"] for s in out["scenarios"] if not s["text"].startswith("not analysed")]
        points = [at(point, s) for s in scenarios if s.name in names]
        done = dict(zip(names, check(obj, rho, points, [weight_at(view_at(obj, rho, p)[0]) for p in points])))
        checks = [done.get(s["name"], {"status": "not checked", "why": "the analysis refuses its held point"})
                  for s in out["scenarios"]]
    for s, c in zip(out["scenarios"], checks):
        s["loss_check"] = c
    return out
