"""The objective's own advantage Â: where the file builds its advantage from the host's A (a
group normalization, a max@k credit, a clipped or shaped advantage), w is taken against that
expression, not against A, so that what the report says of w, its boundaries and the warnings
about |A| are about the advantage the gradient actually carries.

The rule (docs/analysis.md): a node is *advantage-only* when it reads A and no other input but
the fixed ones (seq_len, turn_len, staleness): no r, π, μ, π_old, π_rollout, π_ref, H or Σπ².
Every product and quotient chain is first written with its advantage-only factors together
(r*A/s is r·(A/s)). Â is then the one largest advantage-only node of the terms that read the
policy, the node every A of theirs passes through, where it multiplies what it meets there (a
factor of a product, or a quotient's numerator: never inside a min, a mask or a sum) and is not
A itself (nor A read through a per-response reduction or sg: seq_mean(A) is A in every host). The analysis studies the
objective with Â in A's place; the host's A enters through Â's value on the held group."""
from __future__ import annotations

import re
from fractions import Fraction

from dsl.ir import Node, num, postorder, rebuild, tree_size
from dsl.names import display_name
from dsl.operations import OPS
from dsl.printing import render
from openrlhf_drpo.analysis.budgets import BUDGET
from openrlhf_drpo.analysis.batch.held import STATISTIC_SIZE
from openrlhf_drpo.analysis.mathtext import fmt, math_text

FIXED = frozenset({"A", "seq_len", "turn_len", "staleness"})     # inputs an advantage may read
POLICY = frozenset({"r", "pi", "mu", "pi_old", "pi_rollout", "pi_ref", "H", "sum_pi_sq"})
# what reads A without changing it in any host: A is one value per response
SAME = {"sg"} | {k for k, o in OPS.items() if o.reduce in ("mean", "max", "min", "quantile")
                 and o.over in ("response", "prefix", "turn")}
SPREAD = {"group_std": "the group's spread", "batch_std": "the batch's spread"}
MAGNITUDES = [10.0 ** k for k in range(-12, 13)]    # |A| where Â/A is sampled beside its limit


def _reads(n: Node) -> dict:
    out: dict = {}
    for m in postorder(n):
        out[m] = frozenset([m.value]) if m.op == "var" else frozenset().union(*(out[a] for a in m.args))
    return out


MAX_FACTORS = 64     # a product chain flattened so far, the rest kept whole: b_i = b_(i-1)·b_(i-1) is 2^i factors


def _factors(n: Node, sign=1) -> list:
    """[(±1, factor)] of a mul/div chain, in order (a quotient's denominator −1), at most MAX_FACTORS:
    the chain is a DAG whose shared products would be written out as a tree."""
    out, stack = [], [(n, sign)]
    while stack:
        m, s = stack.pop()
        if m.op in ("mul", "div") and len(out) + len(stack) + 2 <= MAX_FACTORS:
            stack += [(m.args[1], s if m.op == "mul" else -s), (m.args[0], s)]
        else:
            out.append((s, m))
    return out


def _product(parts) -> Node:
    out = None
    for s, f in parts:
        out = (f if s > 0 else Node("div", (num(1), f))) if out is None else Node("mul" if s > 0 else "div", (out, f))
    return out


def _grouped(expr: Node) -> Node:
    """expr with each mul/div chain that mixes advantage-only factors with others written as
    (the others)·(the advantage-only ones), in their order: r*A/s is r·(A/s)."""
    def one(m, args):
        if m.op not in ("mul", "div"):
            return None
        parts = _factors(Node(m.op, args, m.value, m.pos, m.level))
        reads = [_reads(f)[f] for _, f in parts]
        adv = [p for p, x in zip(parts, reads) if "A" in x and x <= FIXED]
        rest = [p for p, x in zip(parts, reads) if not ("A" in x and x <= FIXED)]
        if not adv or not rest or not any(_reads(f)[f] for _, f in rest):
            return None
        return Node("mul", (_product(rest), _product(adv)), pos=m.pos)
    return rebuild(expr, one)


def _largest(expr: Node) -> tuple[list[Node], bool]:
    """The largest advantage-only nodes of expr (those reached from its root through no other),
    and whether each is reached only as a factor of a product (or a quotient's numerator)."""
    reads = _reads(expr)
    found, seen, stack, factors = [], set(), [(expr, None)], True
    while stack:
        m, parent = stack.pop()
        if "A" in reads[m] and reads[m] <= FIXED:
            found.append(m)
            factors &= parent is not None and (parent.op == "mul" or (parent.op == "div" and parent.args[0] is m))
        elif "A" in reads[m] and m not in seen:
            stack.extend((a, m) for a in m.args)
        seen.add(m)
    return found, factors


def _trivial(n: Node) -> bool:
    while n.op in SAME:
        n = n.args[0]
    return n.op == "var" and n.value == "A"


def own_advantage(obj) -> tuple[Node, Node, str] | None:
    """(the objective's expression with Â in A's place, Â's node, its name) or None: Â by the
    module's rule over the top-level terms that read the policy, named by the binding whose
    expression it is, else by its text."""
    from openrlhf_drpo.analysis.batch.view import terms
    grouped = _grouped(obj.expr)
    reads = _reads(grouped)
    live = [t for _, t in terms(grouped) if reads[t] & POLICY]
    found = [_largest(t) for t in live]
    nodes = {n for f, _ in found for n in f}
    if len(nodes) != 1 or not all(factor for _, factor in found) or _trivial(next(iter(nodes))):
        return None
    node = nodes.pop()
    named = [k for k, b in obj.bindings.items() if b == node or _grouped(b) == node]
    swapped = rebuild(grouped, lambda m, args: Node("var", value="A") if m == node else None)
    return swapped, node, display_name(named[-1]) if named else render(node)


# ------------------------------------------------------------------ on the held group
def held_value(obj, node: Node, names: dict, values: dict, group) -> dict:
    """Â on the held group as a formula in the host's A, and where an ε in a denominator alone
    bounds Â/A: its limit as |A| → 0 (the group's spread with it) is finite only through that
    constant (0.5/(√(2/7)·|A| + 1e-6) → 5e5, with the 1e-6 gone → ∞)."""
    import sympy as sp
    from dsl.walks import NotHeld, to_sympy, uniform_view
    A, a = sp.Symbol("A", real=True, nonzero=True), sp.Symbol("a", positive=True)
    env = {"A": A, **{k: sp.Rational(v.numerator, v.denominator) for k, v in {**obj.params, **values}.items()}}

    def lowered(n):
        return sp.simplify(to_sympy(uniform_view(n, obj.options["anchor"], names, group), sp, env))

    def largest_ratio(v):       # |Â/A| as |A| → 0, the larger of the two signs' limits
        return sp.Max(*(sp.limit(sp.Abs(v.subs(A, s * a) / (s * a)), a, 0, "+") for s in (1, -1)))
    if tree_size(node) > STATISTIC_SIZE:        # as a held statistic: past it, Â is named, not evaluated
        return {"value": None, "zero": False, "eps": []}
    try:
        value = lowered(node)
    except NotHeld:         # refused by name, as the view refuses it (analysis.batch.view)
        raise
    except Exception:       # noqa: BLE001 - SymPy raises many types: Â is then named, not evaluated
        return {"value": None, "zero": False, "eps": []}
    # a sign of the host's A that Â sends to 0 ([A < 0]·A): those tokens get no gradient
    dead = [x for s, x in ((1, "A > 0"), (-1, "A < 0")) if sp.simplify(value.subs(A, s * a)) == 0]
    out = {"value": value, "zero": value == 0, "eps": [], "dead": [] if value == 0 else dead}
    if value.count_ops() > BUDGET["limit"]:         # the limits' work budget (analysis.budgets)
        return out
    for eps, other in _eps_divisors(node):
        try:
            q = largest_ratio(value)
            q0 = largest_ratio(lowered(rebuild(node, lambda m, args: num(0) if m is eps else None)))
        except Exception:       # noqa: BLE001 - no limit: no note
            continue
        if q.is_finite and q.is_positive and not q0.is_finite:
            sampled = [abs(float(value.subs(A, s * m))) / m for m in MAGNITUDES for s in (1, -1)]
            if max(sampled) <= float(q) * (1 + 1e-9):       # the limit is Â/A's largest value, as sampled
                out["eps"].append({"sup": float(q), "eps": float(eps.value), "where": _where(other)})
    return out


def _eps_divisors(node: Node) -> list:
    """(ε, the rest of its divisor) for each divisor x + ε with ε a number > 0."""
    out = []
    for m in node.walk():
        if m.op == "div" and m.args[1].op == "add":
            x, y = m.args[1].args
            for eps, other in ((y, x), (x, y)):
                if eps.op == "num" and eps.value > 0 and other.op != "num":
                    out.append((eps, other))
    return out


def _where(other: Node) -> str:
    return SPREAD.get(other.op, render(other))


def describe(name: str, node: Node, held: dict | None, group) -> str:
    """The report's line: what Â is, that w is against it, and what the host's A gives there."""
    text = (f"Â = {name}" + ("" if name == render(node) else f" = {render(node)}")
            + ", the objective's own advantage, built from the host's A: w, its boundaries and the warnings are "
            "against Â (every A below is Â)")
    if held and held["value"] is not None:
        shown = ", ".join(f"{float(c):g}" for c in group)
        text += (f"; on the held group (advantages A·({shown})) Â = {shown_value(held['value'])}"
                 + (": 0 for every A, so no gradient there" if held["zero"] else "")
                 + "".join(f"; Â = 0 for {x}: those tokens get no gradient" for x in held.get("dead", [])))
        for e in held["eps"]:
            text += f", Â/A up to {fmt(e['sup'])} only where {e['where']} → 0: the {fmt(e['eps'])}"
    return text


def shown_value(value) -> str:
    """Â on the held group as a reader writes it: A/(1.06904·|A| + 2e-6), not 3.5e6·A/(…)."""
    import sympy as sp
    A = next((s for s in value.free_symbols if s.name == "A"), None)
    if A is not None:
        n, d = sp.fraction(sp.simplify(value / A))
        if n.is_number and n != 0 and not d.is_number:
            value = A / sp.expand(d / n).evalf(6)
        elif value.has(sp.Float) or any(not x.is_Rational for x in value.atoms(sp.Number)):
            value = value.evalf(6)
    return math_text(value).replace("abs(A)", "|A|")


_A = re.compile(r"(?<![\w^])A(?![\w(])")


def hatted(lines: list[str]) -> list[str]:
    """Lines of the analysis's words about A, said of Â (the analysis studied ℓ with Â as its A)."""
    return [_A.sub("Â", x) for x in lines]


def uniform_point(point: dict, names: dict, group_of) -> tuple[dict, tuple]:
    """The uniform batch's values (view names → Fraction) and the held group, as analysis_view
    takes them from `point`."""
    group = group_of(point.get("group_size"), point.get("group"))
    seq_len = point.get("seq_len", 1)
    G = len(group)
    values = {"seq_len": seq_len, "position": point.get("position") or seq_len, "group_size": G,
              "batch_size": point.get("batch_size") or G}
    return {names[k]: Fraction(v) for k, v in values.items()}, group
