"""The generic walks over the IR, each driven by the operation rows (dsl.operations):
differentiation, Python floats, numpy plans, SymPy, and the view of a sequence objective
on a response whose tokens share their values."""
from __future__ import annotations

import functools
import math
from fractions import Fraction

from dsl.ir import ONE, ZERO, Node, add, div, is_num, mul, num, postorder, power, rebuild, sub
from dsl.levels import argument_level, levels
from dsl.operations import OPS, passes_no_gradient


def constant_nodes(*roots: Node) -> set:
    """The sub-expressions without r, π, μ or A (variables), each found once. A sequence
    reduction is never constant: seq_mean(2) is 2, or 0 on an empty response."""
    out = set()
    for root in roots:
        for n in postorder(root):
            if n.op != "var" and not (n.op in OPS and OPS[n.op].reduce) and all(a in out for a in n.args):
                out.add(n)
    return out


# ---------------------------------------------------------------- differentiation
R_SEEDS = {"r": ONE, "pi": Node("var", value="mu")}


def derivative(n: Node, seeds: dict | None = None) -> Node:
    """The derivative of n given the leaves' derivatives (`seeds`, name -> Node). The
    default is ∂/∂r with μ and A constant (μ is fixed during the update), so dπ/dr = μ;
    the torch compiler passes seeds for ∂/∂log π. Both use the same rules from OPS."""
    seeds = R_SEEDS if seeds is None else seeds
    memo: dict = {}
    for m in postorder(n):      # children first: each shared node is differentiated once
        if m.op == "num" or m.op == "param":
            memo[m] = ZERO
        elif m.op == "var":
            memo[m] = seeds.get(m.value, ZERO)
        elif passes_no_gradient(m.op):
            memo[m] = ZERO      # sg, sign, [..] never look inside; a bare condition is refused below
        elif OPS[m.op].gradient == "reduction":
            # seq_mean(A) is a constant; seq_mean(log r) moves with every token of its response
            memo[m] = ZERO if memo[m.args[0]] is not None and is_num(memo[m.args[0]], 0) else None
        elif any(memo[a] is None for a in m.args):
            memo[m] = None
        else:
            memo[m] = OPS[m.op].gradient(m, [memo[a] for a in m.args])
    if n.op in OPS and OPS[n.op].gradient == "none":
        raise ValueError(f"a condition ({n.op}) has no derivative; it may only appear inside [...]")
    if memo[n] is None:
        raise NonLocal("a reduction of the policy has no per-token derivative: a token's gradient depends on "
                       "other tokens, of its response, its group or the batch (core.codegen differentiates it "
                       "in reverse mode)")
    return memo[n]


class NotHeld(ValueError):
    """uniform_view of a reduction it cannot hold on the held group (`node`: which)."""
    def __init__(self, node, message):
        super().__init__(message)
        self.node = node


class NonLocal(ValueError):
    """derivative() of an objective whose policy gradient passes through a reduction."""


# ---------------------------------------------------------------- lowering
def evaluate(n: Node, env: dict, frozen: dict | None = None) -> float:
    """Python-float value of n; env maps var/param names to floats. With `frozen`, each
    sg(...) keeps the first value it was evaluated at (for finite differences)."""
    memo: dict = {}
    for m in postorder(n):      # children first, each shared node once
        if m.op == "num":
            memo[m] = float(m.value)
        elif m.op in ("var", "param"):
            memo[m] = env[m.value]
        elif frozen is not None and m.op == "sg":
            memo[m] = frozen.setdefault(m, memo[m.args[0]])
        else:
            memo[m] = OPS[m.op].py(*(memo[a] for a in m.args))
    return memo[n]


@functools.lru_cache(maxsize=64)
def numpy_plan(*roots: Node):
    """roots' values over float64 arrays, as one function of env, its evaluation order fixed
    once: the numeric checks evaluate one expression thousands of times. With `frozen` (a
    dict, filled on the first call), each sg(...) keeps its first values, for finite
    differences. The plan is straight-line Python compiled once: a loop over a 1,500-node plan
    cost ~2 ms a call in interpretation alone, most of the arbiter's time on large objectives."""
    import numpy as np
    order, index = [], {}
    for root in roots:          # shared nodes of several roots are evaluated once
        for m in postorder(root):
            if m not in index:
                index[m] = len(order)
                order.append(m)
    names = {"np": np, "math": math, "_reduce": functools.reduce}
    lines = ["def run(env, frozen=None):", "    with np.errstate(all='ignore'):"]
    for i, m in enumerate(order):
        args = [f"v{index[a]}" for a in m.args]
        if m.op == "num":
            names[f"c{i}"] = _to_float(m.value)
            value = f"c{i}"
        elif m.op in ("var", "param"):
            value = f"env[{m.value!r}]"
        elif m.op == "sg":
            value = f"{args[0]} if frozen is None else frozen.setdefault({i}, {args[0]})"
        else:
            value = OPS[m.op].np(*args)
        lines.append(f"        v{i} = {value}")
    lines.append(f"    return [{', '.join(f'v{index[root]}' for root in roots)}]")
    exec(compile("\n".join(lines), "<numpy_plan>", "exec"), names)
    return names["run"]


def _to_float(v: Fraction) -> float:
    try:
        return float(v)
    except OverflowError:       # 10^400 as a double, as torch would hold it
        return math.copysign(math.inf, v)


def to_sympy(n: Node, sp, env: dict, hook=None, memo: dict | None = None):
    """Lower to SymPy. env maps names to SymPy objects; `hook(expr)` post-processes every
    lowered node (the analysis settles conditions there). Relations are built unevaluated:
    deciding them is the hook's job. Shared subtrees are lowered once, children first."""
    memo = {} if memo is None else memo
    for m in postorder(n):
        if m in memo:
            continue
        if m.op == "num":
            out = sp.Rational(m.value.numerator, m.value.denominator)
        elif m.op in ("var", "param"):
            out = env[m.value]
        else:
            out = OPS[m.op].sympy(sp, *(memo[a] for a in m.args))
        memo[m] = hook(out) if hook else out
    return memo[n]


def reads_whole_response(n: Node) -> bool:
    """A reduction (of a response, a prefix, a group or the batch), or a response's length: a
    value that needs more than its own token."""
    return (n.op in OPS and bool(OPS[n.op].reduce)) or (n.op == "var" and n.value in ("seq_len", "turn_len"))


# The parameters uniform_view writes for what it holds (analysis.batch.view renames one a file already uses)
VIEW_NAMES = {"seq_len": "seq_len", "position": "p", "group_size": "G", "batch_size": "N", "rho": "rho",
              "rho_ref": "rho_ref", "H": "H", "staleness": "staleness"}


def held_count(op: str, level: str, point: dict) -> Node:
    """How many elements reduction `op` reduces at uniform_view's point (`point`: the parameters
    seq_len |y|, position p, group_size G and batch_size N, as Nodes), as its row declares (Op.held)."""
    return OPS[op].held(level, point)


def _response(n: Node, c: Fraction, new: dict, level: dict, point: dict) -> Node:
    """n's value in a response of the held group whose advantage is c·A: A scaled, a value that is
    already the group's or the batch's (new's, a wider reduction) kept, the rest rebuilt as in
    uniform_view (`new` holds its values on the token's own response)."""
    def one(m, args):
        if m.op == "var" and m.value == "A":
            return mul(num(c), new[m])
        if m.op in OPS and OPS[m.op].reduce and OPS[m.op].over in ("group", "batch"):
            return new[m]
        if m.op in OPS and OPS[m.op].reduce:
            return OPS[m.op].uniform(args[0], held_count(m.op, argument_level(m, level), point), *args[1:])
        return None if m.args else new[m]
    return rebuild(n, one)


def _reads_own_advantage(n: Node) -> bool:
    """Whether n reads its response's A outside a group or batch reduction (whose value is the group's)."""
    stack = [n]
    while stack:
        m = stack.pop()
        if m.op == "var" and m.value == "A":
            return True
        if not (m.op in OPS and OPS[m.op].reduce and OPS[m.op].over in ("group", "batch")):
            stack.extend(m.args)
    return False


def uniform_view(n: Node, anchor: str, names: dict | None = None, group: tuple | None = None,
                 level: dict | None = None) -> Node:
    """The objective on a uniform batch, in r, μ, A and parameters (`names`, VIEW_NAMES by
    default): N responses in groups of G, each of |y| tokens, every token sharing r, μ, A and the
    held inputs, seen at position p of its response. Each reduction is its value there
    (seq_mean(x) = x, seq_sum(x) = |y|·x, prefix_sum(x) = p·x, turn_sum(x) = |y|·x: the response is one turn,
    turn_len = |y|; group_sum(x) = G·x, group_std(x) =
    0, group_count(x) = G, batch_sum(x) = N·|y|·x or N·x: held_count). The policy μ is not is μ
    times the train/rollout ratio ρ: π_old = μ·ρ under @anchor = rollout, π_rollout = μ/ρ under
    @anchor = old; π_ref = μ·ρ_ref (so π_ref/π = ρ_ref/r); H and staleness are parameters; Σ_v π_v² =
    sg(π² + (1 − π)²) (the rest of the mass on one other token). A token-level objective that
    names none of these is returned as it is. `group`: the group's advantages as multiples of the
    token's A (its response first; the batch holds N/G such groups): a group or batch reduction of
    a value that reads A is then its value over them (spread), all else shared. `level`: n's
    levels (dsl.levels), where the caller has them (an objective's facts)."""
    names = {**VIEW_NAMES, **(names or {})}
    point = {k: Node("param", value=v) for k, v in names.items()}
    mu, pi = Node("var", value="mu"), Node("var", value="pi")
    other = {"old": ("pi_rollout", div(mu, point["rho"])), "rollout": ("pi_old", mul(mu, point["rho"]))}[anchor]
    held = {f"pi_{anchor}": mu, other[0]: other[1], "seq_len": point["seq_len"], "pi_ref": mul(mu, point["rho_ref"]),
            "H": point["H"], "turn_len": point["seq_len"], "staleness": point["staleness"],
            "sum_pi_sq": Node("sg", (add(power(pi, num(2)), power(sub(ONE, pi), num(2))),))}
    level = levels(n) if level is None else level
    new: dict = {}

    def one(m, args):
        if m.op == "var" and m.value in held:
            return held[m.value]
        if not (m.op in OPS and OPS[m.op].reduce):
            return None
        op = OPS[m.op]
        count = held_count(m.op, argument_level(m, level), point)
        # a group or batch reduction declares its spread (dsl.uniform.SPREAD): None, it reads no value
        # (a count); a string, why it is not derived (a quantile's neighbours' ranks depend on N and A's sign)
        spreads = group and len(set(group)) > 1 and op.over in ("group", "batch") and op.spread is not None \
            and _reads_own_advantage(m.args[0])
        if spreads and isinstance(op.spread, str):
            raise NotHeld(m, f"{m.op} of a value that reads A is not analysed on a held group whose advantages differ")
        if spreads:
            shares = {c: Fraction(group.count(c), len(group)) for c in group}
            return op.spread([(_response(m.args[0], c, new, level, point), k) for c, k in shares.items()],
                             num(len(group)) if op.over == "group" else count)
        return op.uniform(args[0], count, *args[1:])
    return rebuild(n, one, new)
