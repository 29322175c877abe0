"""What the analysis holds fixed for the language's third version, and the words that state it:
the uniform batch (N responses in groups of G, each of |y| tokens that share r, μ, A, seen at
position p), the reference policy relative to μ, the entropy, Σ_v π_v², and the statistics a file
names that the batch or the group supplies under sg (a batch's ESS): each such binding is held
as a parameter of the analysis, at its value on the uniform batch unless set."""
from __future__ import annotations

from fractions import Fraction

from dsl.ir import postorder, tree_size
from dsl.levels import reductions
from dsl.names import GRADIENT, display_name
from dsl.operations import OPS, passes_no_gradient
from dsl.printing import render
from dsl.walks import to_sympy, uniform_view

GROUP_SIZE = 8      # responses per prompt where nothing says otherwise (TRL's num_generations default)
HELD = {"H": Fraction(1), "rho_ref": Fraction(1), "staleness": Fraction(1)}  # H in nats; ρ_ref = π_ref/μ (π_ref = μ)
FLOAT_MAX = 1.7976931348623157e308       # the largest finite double: a held advantage is read as one
STATISTIC_SIZE = 400        # operations of a binding the uniform value is simplified for


def _carries_gradient(n) -> bool:
    """Whether π, r or H reach n through something with a derivative (dsl.expressions' rule)."""
    live = set()
    for m in postorder(n):
        counts = m.op in OPS and OPS[m.op].reduce == "count"
        if (m.op == "var" and m.value in GRADIENT) or (
                m.op in OPS and not passes_no_gradient(m.op) and not counts and any(a in live for a in m.args)):
            live.add(m)
    return n in live


def held_group(group_size, group) -> tuple:
    """The held group: its G responses' advantages as multiples of the analysed token's A, the
    token's own response first (1). By default binary rewards with a spread, as a GRPO group a
    researcher knows: the token's response and ⌈G/2⌉ − 1 others score A, the other ⌊G/2⌋ score 0,
    so that for A > 0 the token is in a winning response and for A < 0 in a losing one (on equal
    responses, where A − group_mean(A) ≡ 0, a normalized advantage would leave nothing to analyse).
    `group` sets it (its length is G; group_size, where given too, must agree)."""
    if group is None:
        G = GROUP_SIZE if group_size is None else group_size
        if isinstance(G, bool) or not isinstance(G, int) or G < 1:
            raise ValueError(f"group_size must be a positive integer, got {G!r}")
        return tuple(Fraction(int(i < (G + 1) // 2)) for i in range(G))
    try:
        values = tuple(Fraction(str(v)) if isinstance(v, float) else Fraction(v) for v in group)
    except (TypeError, ValueError):
        raise ValueError(f"group {tuple(group)!r}: each response's advantage is a finite number (a multiple of the "
                         "token's A), e.g. group=(1, 1, 0, 0)") from None
    too_large = [v for v in values if abs(v) > Fraction(FLOAT_MAX)]
    if too_large:       # exact as a Fraction, but every report and check reads it as a double
        raise ValueError(f"each response's advantage is a finite float (a multiple of the token's A), and entry "
                         f"{values.index(too_large[0]) + 1} is past the largest double (±{FLOAT_MAX:.4g})")
    if not values or values[0] != 1:
        shown = ", ".join(f"{float(v):g}" for v in values)
        raise ValueError(f"group ({shown}): the first response is the analysed token's, whose advantage is A itself: "
                         "its entry is 1, e.g. 1, 1, 0, 0")
    if group_size is not None and group_size != len(values):
        raise ValueError(f"group_size {group_size} disagrees with the held group's {len(values)} responses")
    return values


def _spread_reads(obj) -> list:
    """The group and batch sums, means and stds whose argument reads A (the held group spreads them),
    by a walk: a view that asks only which there are (an indicator's, per scenario) computes no
    reductions of its own."""
    return [n for n in obj.expr.walk() if n.op in OPS and OPS[n.op].reduce and OPS[n.op].reduce != "count"
            and OPS[n.op].over in ("group", "batch") and any(m.op == "var" and m.value == "A" for m in n.args[0].walk())]


def _spread_gradient(obj) -> bool:
    """Whether a gradient passes through one of them."""
    nodes = set(_spread_reads(obj))
    return bool(nodes) and any(r.gradient for r in obj.facts.reductions if r.node in nodes)


def spread(obj, group, explicit=True) -> bool:
    """Whether a reduction that passes a gradient reads the held group's spread advantages, or
    (where the group's advantages are given: `explicit`) one passes a gradient while ℓ reads A
    outside every group and batch reduction (r/group_mean(r)·A): w is then ∂ℓ/∂r with every
    response's r moving together, which is not one token's own gradient (that collects the other
    responses' terms, which differ by their advantages)."""
    if len(set(group)) <= 1:
        return False
    return _spread_gradient(obj) or explicit and _terms_differ(obj)


def _terms_differ(obj) -> bool:
    def outside(n) -> bool:         # A read where no group or batch reduction holds it
        if n.op in OPS and OPS[n.op].over in ("group", "batch"):
            return False
        return (n.op == "var" and n.value == "A") or any(map(outside, n.args))
    return any(r.gradient for r in obj.facts.reductions if r.over in ("group", "batch")) and outside(obj.expr)


def equal_group(obj, group) -> bool:
    """Whether a group or batch reduction reads A while the held group's advantages are all equal:
    each such statistic is then trivial there (group_mean(A) = A, group_std(A) = 0), so a weight
    that vanishes at this held point says nothing of the objective until another point shows it."""
    return len(set(group)) == 1 and bool(_spread_reads(obj))


def statistics(obj, anchor: str, names: dict, values: dict, group=None) -> dict:
    """{binding name: (its node, its value on the uniform batch)} for each binding of obj that
    carries no gradient, reads the current policy through a group or batch reduction, and is a
    number on the uniform batch (a batch's ESS is 1 there). A binding inside another such one is
    held with it. One whose uniform value moves with r (sg(group_mean(r)) is r) is not held:
    the view keeps that value; but a batch's statistic is held at its value at r = 1 (the
    default) where that is a number: one token does not move the batch's (FeynRL's ESS with
    its + 1e-8 moves with r on the uniform batch, and that form took SymPy past its guard)."""
    found, facts = {}, obj.facts
    for name, node in obj.bindings.items():
        # a binding the objective uses is a sub-expression: its reductions and levels are the objective's
        used, inside = node in facts.level, set(node.walk())
        overs = {r.over for r in (facts.reductions if used else reductions(node)) if r.policy and r.node in inside}
        if overs & {"group", "batch"} and not _carries_gradient(node) and tree_size(node) <= STATISTIC_SIZE:
            value = _uniform_value(node, anchor, names, {**obj.params, **values}, on_policy="batch" in overs,
                                   group=group, level=facts.level if used else None)
            if value is not None:
                found[name] = (node, value)
    inner = {k for k, (node, _) in found.items() if any(node in set(o.walk()) for j, (o, _) in found.items() if j != k)}
    return {k: v for k, v in found.items() if k not in inner}


def _uniform_value(node, anchor, names, params, on_policy=False, group=None, level=None):
    """node's value on the uniform batch, if it is one number for every r, μ and A; with
    on_policy, else its value there at r = 1 if that is one number (an OnPolicy)."""
    import sympy as sp
    r, mu = sp.symbols("r mu", positive=True)
    env = {"r": r, "mu": mu, "pi": mu * r, "A": sp.Symbol("A", real=True, nonzero=True),
           **{k: sp.Rational(v.numerator, v.denominator) for k, v in params.items()}}
    kind, point = Fraction, (r, mu, env["A"])
    try:
        value = to_sympy(uniform_view(node, anchor, names, group, level), sp, env)
        if _moves(value, point):    # two values at two points: no simplification makes it one number
            if not on_policy or _moves(value.subs(r, 1), point):
                return None
            value, kind = value.subs(r, 1), OnPolicy
        value = sp.simplify(value)
    except Exception:       # noqa: BLE001 - SymPy raises many types: not a held statistic then
        return None
    if value.free_symbols and on_policy and kind is Fraction:
        value, kind = sp.simplify(value.subs(r, 1)), OnPolicy
    if value.free_symbols or not value.is_real or not value.is_finite:
        return None
    return kind(value.p, value.q) if value.is_Rational else kind(repr(float(value)))


def _moves(value, symbols) -> bool:
    """Whether value takes two values at two points of r, μ > 0 and A ≠ 0, each found to 60
    digits and to 120 and their gap far past the two precisions' disagreement (rounding): then it
    is no number, and sp.simplify (most of a scenario's cost) need not say so. False where it reads
    another symbol, or a point gives no finite real number or a node _at does not know: simplify
    decides, as before."""
    import mpmath
    import sympy as sp
    if not value.free_symbols or not value.free_symbols <= set(symbols):
        return False
    at = {}
    for digits in (60, 120):
        with mpmath.workdps(digits):
            try:
                at[digits] = [_at(sp, mpmath, value, dict(zip(symbols, map(mpmath.mpf, point))))
                              for point in (("1.37", "0.213", "0.71"), ("0.61", "0.437", "-1.3"))]
            except (_Unknown, ArithmeticError, ValueError, TypeError, StopIteration):
                return False
    if not all(mpmath.isfinite(v) and isinstance(v, mpmath.mpf) for v in at[60] + at[120]):
        return False
    rounding = max(abs(a - b) for a, b in zip(at[60], at[120]))
    return abs(at[120][0] - at[120][1]) > max(mpmath.mpf("1e-30"), 1e10 * rounding) * max(1, *map(abs, at[120]))


class _Unknown(Exception):
    """A node _at has no rule for."""


def _at(sp, mp, e, point):
    """e at point ({symbol: mpf}) in mpmath's working precision: SymPy's own evalf cannot
    rebuild a Piecewise whose condition is a settled `8 >= 2`, which the uniform view makes."""
    unary = {sp.exp: mp.exp, sp.log: mp.log, sp.Abs: abs, sp.sign: mp.sign}
    rel = {sp.Lt: lambda a, b: a < b, sp.Le: lambda a, b: a <= b, sp.Gt: lambda a, b: a > b,
           sp.Ge: lambda a, b: a >= b, sp.Eq: lambda a, b: a == b, sp.Ne: lambda a, b: a != b,
           sp.Min: min, sp.Max: max, sp.And: lambda *a: all(a), sp.Or: lambda *a: any(a),
           sp.Not: lambda a: not a}

    def ev(x):
        if x in point:
            return point[x]
        if x.is_Number or x.is_NumberSymbol:
            return mp.mpf(x.evalf(mp.mp.dps))
        if x is sp.true or x is sp.false:
            return bool(x)
        args = [ev(a) for a in x.args] if not isinstance(x, sp.Piecewise) else None
        if x.is_Add:
            return mp.fsum(args)
        if x.is_Mul:
            return mp.fprod(args)
        if x.is_Pow:
            return mp.power(*args)
        if x.func in unary and len(args) == 1:
            return unary[x.func](args[0])
        if x.func in rel:
            return rel[x.func](*args)
        if isinstance(x, sp.Piecewise):     # the first piece whose condition holds
            return next(ev(v) for v, c in x.args if ev(c))
        raise _Unknown(x.func)
    return ev(e)


class OnPolicy(Fraction):
    """A statistic's default where its uniform value moves with r: its value at r = 1, which no
    other uniform batch has (the analysis says it holds the statistic away from its uniform value)."""


def holdable(obj, stats: dict) -> set[str]:
    """The names --set may give a held value (the analysis's own, not the file's parameters)."""
    reads = obj.names()
    return {k for k, builtin in (("H", "H"), ("rho_ref", "pi_ref"), ("staleness", "staleness"))
            if builtin in reads} | set(stats)


def _group_text(point, group) -> str:
    shown = ", ".join(f"{float(c):g}" for c in group)
    default = group == held_group(len(group), None)
    return (f"a group of G = {point['group_size']} responses (--group-size; --group C1,...,CG sets each): their "
            f"advantages are A·({shown}), the token's response first, and they share r, μ and |y|"
            + (" (binary rewards with a spread: for A > 0 the token is in a winning response, for A < 0 in a "
               "losing one)" if default else "")
            + ": group_sum, group_mean and group_std of a value that reads A are over these responses, "
            "group_count(x) = G; of any other value, as on equal responses (group_mean(x) = x, group_std(x) = 0)")


def statements(obj, point: dict, stats: dict, values: dict, group=(1,), explicit=False) -> list[dict]:
    """What the view holds that obj reads, each {name, value, text} in the order the report
    lists them (the uniform batch's shape first); G's also {group}, the advantages as multiples
    of A, where they enter the view or --group (`explicit`) set them."""
    overs = {OPS[n.op].over for n in obj.expr.walk() if n.op in OPS and OPS[n.op].reduce}
    reads = obj.names()
    values = {k: float(v) for k, v in values.items()}
    out = []
    spread_overs = {OPS[n.op].over for n in _spread_reads(obj)} if len(set(group)) > 1 else set()
    # the order statistics, said only where read (the other reports' lines are as they were)
    extremes = [k for k in ("group_max", "group_min") if any(n.op == k for n in obj.expr.walk())]
    order = f", {' = '.join(f'{k}(x)' for k in extremes)} = x" if extremes else ""
    quantile = ", batch_quantile(x, q) = x" if any(n.op == "batch_quantile" for n in obj.expr.walk()) else ""
    if spread_overs:
        out.append(("G", point["group_size"], _group_text(point, group) + (
            f"; {' and '.join(extremes)} of a value that reads A {'is' if len(extremes) == 1 else 'are'} over "
            "these responses too" if extremes else "")))
    elif "group" in overs:
        shown = ",".join(f"{float(c):g}" for c in group)
        source = ("--group-size" if not explicit else f"--group {shown}: every response's advantage is A"
                  if len(set(group)) == 1 else f"G from --group {shown}: no group reduction here reads A")
        out.append(("G", point["group_size"], f"a group of G = {point['group_size']} equal responses ({source}): "
                    f"group_sum(x) = G·x, group_mean(x) = x, group_std(x) = 0, group_count(x) = G{order}"))
    if "batch" in spread_overs:
        out.append(("N", point["batch_size"], f"a batch of N = {point['batch_size']} responses (--batch-size), N/G "
                    "such groups: a batch reduction of a value that reads A is over their advantages, of any other "
                    "value batch_sum(x) = N·|y|·x over its tokens or N·x over its responses, "
                    f"batch_mean(x) = x{quantile}"))
    elif "batch" in overs:
        out.append(("N", point["batch_size"], f"a batch of N = {point['batch_size']} such responses (--batch-size): "
                    "batch_sum(x) = N·|y|·x over its tokens or N·x over its responses, batch_mean(x) = x, "
                    f"batch_count(x) = N·|y| or N{quantile}"))
    if "prefix" in overs:
        out.append(("p", point["position"], f"the token at position p = {point['position']} of its response "
                    "(--position; the last by default): prefix_sum(x) = p·x, prefix_mean(x) = x"))
    if "turn" in overs or "turn_len" in reads:
        out.append(("turn_len", None, "the response is one turn (its tokens share r, μ and A): turn_sum(x) = |y|·x, "
                    "turn_mean(x) = x, turn_len = |y|"))
    if "pi_ref" in reads:
        out.append(("rho_ref", values["rho_ref"], f"π_ref = ρ_ref·μ, ρ_ref = π_ref/μ held at {values['rho_ref']:.12g} "
                    "(--set rho_ref=X): the reference terms read π_ref/π = ρ_ref/r"))
    if "H" in reads:
        out.append(("H", values["H"], f"H = {values['H']:.12g} nat (--set H=X), the entropy at the token"))
    if "staleness" in reads:
        out.append(("staleness", values["staleness"], f"staleness = {values['staleness']:.12g} policy versions "
                    "(--set staleness=X), the same on every token"))
    if "sum_pi_sq" in reads:
        out.append(("sum_pi_sq", None, "Σ_v π_v² = π² + (1 − π)² (the rest of the mass on one other token), "
                    "without gradient"))
    for name, (node, default) in stats.items():
        where = "at r = 1, where it moves with r" if isinstance(default, OnPolicy) else ""
        out.append((name, values[name], f"{display_name(name)} = {render(node)} held as a parameter at "
                    f"{values[name]:.12g} (its value on the uniform batch{where and ' ' + where}: "
                    f"{float(default):.12g}; --set {name}=X): no gradient passes through it"))
    said = [{"name": n, "value": v, "text": t} for n, v, t in out]
    for h in said:
        if h["name"] == "G" and (spread_overs or explicit):
            h["group"] = [float(c) for c in group]
    return said


def exactness(obj, locality: dict, moved: list[str], in_weight: list[str] = (), spread_gradient: bool = False) -> str:
    """What the weight is on the uniform batch, and what the analysis does not claim there.
    `moved`: the statistics held away from their uniform value; `in_weight`: the held values
    ∂ℓ/∂r reads ('ess = 1'), at which w and its boundaries are evaluated."""
    prefix = any(r.gradient and r.over == "prefix" for r in obj.facts.reductions)
    wide = {"token": "", "response": "its response", "group": "its group", "batch": "the batch"}[locality["gradient"]]
    text = ("there each token's gradient is w·r·A (plus w_H·∇H where it reads H) times its aggregation weight, "
            "exactly: the tokens a reduction passes a gradient through all move alike, and a value under sg enters "
            "as a number")
    if prefix:
        text = ("a prefix reduction passes a gradient: w at position p is ∂ℓ_p/∂r with the whole prefix moving "
                "together, which is not token p's own gradient (that also collects the later tokens' terms: not "
                "derived)")
    if spread_gradient:
        which = ("that reads A passes a gradient" if _spread_gradient(obj) else
                 "passes a gradient and ℓ reads each response's own A")
        text = (f"a group or batch reduction {which}: w is ∂ℓ/∂r with every response's r "
                "moving together, which is not one token's own gradient where the group's advantages differ (that "
                "also collects the other responses' terms: not derived)")
    if moved:
        text += (f"; {', '.join(map(display_name, moved))} held away from its value on the uniform batch: no "
                 "uniform batch has it, and w is the token's weight given that value")
    if in_weight:
        text += (f"; w, its cases and its boundaries below are evaluated at the held {', '.join(in_weight)}: numbers "
                 "there, not functions of them (they move with them: --set and the batch's shape give others)")
    if wide:
        text += f"; away from the uniform batch a token's gradient also depends on the rest of {wide}: not analysed"
    return text
