"""The IR rewrites the torch code is generated from (core.codegen): the log of a built-in
probability as the log-prob tensor itself, [c]·x as select(c, x), each group and batch reduction
with its argument's level, and the objective's filters (the [...] factors that drop tokens or
responses for the whole update)."""
from __future__ import annotations

import warnings

from dsl.adjoints import picked
from dsl.ir import ONE, ZERO, Node, div, mul, neg, postorder, rebuild
from dsl.levels import LEVELS, argument_level, levels
from dsl.operations import OPS, passes_no_gradient
from dsl.walks import constant_nodes


# log of a built-in probability is emitted as the log-prob itself: exact for tiny π
# (no exp/log round trip) and its derivative needs no division by π.
_LOG_ATOMS = {"pi": "logp", "r": "log_ratio", "mu": "anchor", "pi_old": "old", "pi_rollout": "rollout",
              "pi_ref": "ref", "pi_v": "lv", "pi_ref_v": "lref"}


def rewrite_logs(root: Node) -> Node:
    return rebuild(root, lambda n, args: Node("var", value=_LOG_ATOMS[n.args[0].value]) if (
        n.op == "log" and n.args[0].op == "var" and n.args[0].value in _LOG_ATOMS) else None)


def select_masks(root: Node) -> Node:
    """[c]·x as select(c, x): x where c holds, else 0, even where x is inf or NaN (an IS weight
    that overflowed on a token the band drops). A select is lifted out of the product, negation
    or quotient it is a factor of ([c]·k·ℓ is select(c, k·ℓ)), so that a non-finite ℓ never
    meets 0 either; where c holds the product is the one written, in its order."""
    return rebuild(root, lambda n, args: _lifted(n.op, args) if n.op in _LIFTS else None)


# each operation a select is lifted out of, rebuilt on the select's own argument (ir's helpers: 1·z is z)
_LIFTS = {"mul": mul, "neg": neg, "div": div}


def _lifted(op: str, args: tuple) -> Node:
    for i, a in enumerate(args[:1] if op == "div" else args):       # (a quotient's numerator only)
        if a.op in ("ind", "select"):
            y = ONE if a.op == "ind" else a.args[1]
            return Node("select", (a.args[0], _lifted(op, args[:i] + (y,) + args[i + 1:])))
    return _LIFTS[op](*args)


def guard_selects(root: Node) -> Node:
    """Each select(c, x) with what x reads of the policy (π's leaves, and reductions of π, which
    spread a gradient over other tokens) selected by c too: the gradient reaching them is then 0
    where c fails, whatever x's own backward holds there (0·NaN after a division by a group's zero
    spread, the log of a negative number), in autograd and in the reverse mode alike: the double
    `where` (forward mode's rule select(c, dx) needs none). min, max and clip select a branch
    too, each guarded by its own condition (GSPO's unclipped branch s·A is inf in fp32 where the
    clipped one is chosen), and an order statistic (max, min, a quantile) or a standard deviation its
    argument, by where it picks the element (dsl.adjoints.picked; elsewhere sg of it, the same value);
    below any other reduction of a non-linear value, a selection above reaches the elements it drops
    (read_by). Every value is unchanged (but a −0 may read +0).
    A node under nested branches is guarded by all their conditions, so a node shared by many
    (a chain of min's of its own bindings) has one copy per path: past a budget of copies, each
    is guarded by its nearest condition alone (one copy per branch above it), which no longer
    keeps an outer filter's non-finite branch out of the gradient: said in a warning."""
    try:
        return _guarded(root, 8 * len(postorder(root)) + 256)
    except _OverBudget:
        warnings.warn("openrlhf_drpo: the objective nests its filters and min/max/clip branches too deeply for "
                      "every branch to be guarded by all the conditions above it: a NaN or inf in a branch that an "
                      "outer filter drops can reach the gradient on the plain path and in reverse mode (keep the "
                      "values a filter drops finite, or nest fewer min/max/clip levels under it)", stacklevel=2)
        return _guarded(root, None)


class _OverBudget(Exception):
    pass


def _guarded(root: Node, budget: int | None) -> Node:
    """guard_selects' walk: the conditions nested, in at most `budget` copies (None: the nearest only)."""
    known: dict = {}

    def reads(n: Node) -> bool:      # whether a gradient reaches π's leaves through n
        if n not in known:
            known[n] = (n.value in _POLICY) if n.op == "var" else bool(n.args) and OPS[n.op].gradient not in (
                "zero", "none") and any(reads(a) for a in n.args)
        return known[n]
    # linear: every partial on the way to π's leaves is finite where the inputs are (sums, differences, a product
    # with an input or a number, a division by a nonzero number, sums and means of these), so an unselected
    # element meets no 0·inf below it and a reduction of it needs no guard (GSPO's mean log-ratio, OTB's prefix sums)
    linear: dict = {}
    for n in postorder(root):       # (children first: no deep recursion)
        one = sum(reads(a) for a in n.args) <= 1 and all(linear[a] for a in n.args)
        given = all(reads(a) or not a.args for a in n.args)     # (the factor a product's partial is: an input)
        linear[n] = not reads(n) or not n.args or one and (n.op in ("add", "sub", "neg", "select") or (
            n.op == "mul" and given) or (n.op == "div" and n.args[1].op == "num" and n.args[1].value != 0) or (
            OPS[n.op].reduce in ("sum", "mean")))
    memo: dict = {}

    def under(c, cond):
        return cond if c is None or budget is None else Node("and", (c, cond))

    def branch(cond, x, c):          # x where cond holds, what it reads of π guarded by cond too
        return Node("select", (cond, walk(x, under(c, cond))))

    def extreme(op, args, c):        # as dsl.lowerings.torch_extreme: the first attaining it wins
        first, rest = args[0], (args[1] if len(args) == 2 else Node(op, args[1:]))
        if _constant(rest):          # torch.clamp(first, bound): NaN stays, a tie is first's
            loses = Node("gt" if op == "min" else "lt", (first, rest))
            wins = Node("not", (loses,))
        else:                        # torch.where(first <= rest, first, rest)
            wins = Node("le" if op == "min" else "ge", (first, rest))
            loses = Node("not", (wins,))
        if _constant(rest) or len(args) == 2:
            other = Node("select", (loses, rest)) if _constant(rest) else branch(loses, rest, c)
        else:
            other = Node("select", (loses, extreme(op, args[1:], under(c, loses))))
        return Node("add", (branch(wins, first, c), other))

    def read_where(cond, x):         # x where cond holds (guarded by it), else sg(x): the same value
        return Node("add", (branch(cond, x, None), Node("select", (Node("not", (cond,)), Node("sg", (x,))))))

    def walk(n: Node, c):     # c: the conditions n's value is selected by, up to a reduction (None: none)
        if not reads(n):
            return n
        if (n, c) not in memo:
            if not n.args:
                out = n
            elif n.op == "select":
                out = branch(n.args[0], n.args[1], c)
            elif n.op in ("min", "max"):
                out = extreme(n.op, n.args, c)
            elif n.op == "clip" and _constant(n.args[1]) and _constant(n.args[2]):   # torch.clamp(x, lo, hi)
                x, lo, hi = n.args
                inside = Node("and", (Node("not", (Node("lt", (x, lo)),)), Node("not", (Node("gt", (x, hi)),))))
                out = Node("add", (branch(inside, x, c),
                                   Node("select", (Node("not", (inside,)), Node("clip", (Node("sg", (x,)), lo, hi))))))
            elif n.op == "clip":    # min(max(x, lo), hi), as dsl.lowerings.torch_clip
                out = walk(Node("min", (Node("max", n.args[:2]), n.args[2])), c)
            elif OPS[n.op].reduce in ("max", "min", "quantile", "std"):   # x where picked, else sg(x): same value
                chosen = picked(n, Node("sg", (n.args[0],)))
                chosen = chosen if c is None or linear[n.args[0]] else Node("and", (chosen, read_by(n, c)))
                out = Node(n.op, (read_where(chosen, n.args[0]), *n.args[1:]), n.value, n.pos, n.level)
            elif OPS[n.op].reduce:      # an element whose every reader c drops: as sg(x), the same value
                below = c is not None and not passes_no_gradient(n.op) and not linear[n.args[0]]
                x = read_where(read_by(n, c), n.args[0]) if below else walk(n.args[0], None)
                out = Node(n.op, (x, *n.args[1:]), n.value, n.pos, n.level)
            else:
                out = Node(n.op, tuple(walk(a, c) for a in n.args), n.value, n.pos, n.level)
            memo[n, c] = out if c is None or (n.args and not OPS[n.op].reduce) else Node("select", (c, out))
            if budget is not None and len(memo) > budget:
                raise _OverBudget
        return memo[n, c]
    return walk(root, None)


# the widest level that is one value over each set a kind of reduction reduces (a response's tokens, a
# group's, the batch's, a token's support)
_HELD_OVER = {"response": "response", "prefix": "response", "suffix": "response", "turn": "response",
              "group": "batch", "batch": "batch", "vocab": "token"}


def read_by(n: Node, c: Node) -> Node:
    """Where an element of the reduction n's argument is read by an element of n that c selects: c itself
    where it is held over n's sets, else where the adjoint of the same kind of sum, given [c], is nonzero
    (what gathers n's gradient gathers [c]: a reduction of a condition, computed only where needed)."""
    if held(n, c):
        return c
    over, x = OPS[n.op].over, n.args[0]
    total = next(k for k, op in OPS.items() if op.over == over and op.reduce == "sum" and callable(op.adjoint))
    return Node("gt", (OPS[total].adjoint(Node(total, (x,), level=n.level), Node("ind", (c,)), x), ZERO))


def held(n: Node, c: Node) -> bool:
    """Whether the condition c is one value over each set of elements the reduction n reduces, so that
    where it fails at an element it fails at every element that reads it, and the element's gradient is
    selected out below n too (an order statistic's unpicked group_std, its members' 0·inf): c reads only
    n's own value (one over each of its sets, but a prefix's or suffix's) and values held over them."""
    over, level, ok = OPS[n.op].over, levels(c), {}
    widest = LEVELS.index(_HELD_OVER[over])
    for m in postorder(c):
        ok[m] = (m == n and over not in ("prefix", "suffix")) or LEVELS.index(level[m]) <= widest or (
            bool(m.args) and not OPS[m.op].reduce and all(ok[a] for a in m.args))     # (another reduction: its level)
    return ok[c]


def guard_autograd(root: Node) -> Node:
    """The plain path's own guards, for autograd, which reads every value at every token (a masked one
    too: its ℓ is computed, then selected out) and differentiates below everything: each reduction
    that passes a gradient as select(m, ·), so that a masked token's backward (0·inf where a division
    meets its 0 length, count or input) never reaches the tokens the reduction read; and the argument
    of sign (a row whose gradient is "zero") detached, so that 0·NaN below it (sqrt of a negative
    number a select dropped) stays out. Reverse mode has both by construction: its adjoints read the
    unmasked tokens only, and it never descends below a row with no gradient."""
    mask = Node("var", value="m")

    def one(n: Node, args: tuple):
        if n.op not in OPS or (n.op == "sg" or not n.args):
            return None
        if OPS[n.op].reduce and not passes_no_gradient(n.op):
            return Node("select", (mask, Node(n.op, args, n.value, n.pos, n.level)))
        if OPS[n.op].gradient == "zero" and OPS[n.op].args_kind == "num":
            return Node(n.op, tuple(Node("sg", (a,)) for a in args), n.value, n.pos, n.level)
        return None
    return rebuild(root, one)


def _constant(n: Node) -> bool:
    """Folded to a number in the generated code (a literal, which the lowerings treat apart)."""
    return n in constant_nodes(n)


def annotate_levels(root: Node, level: dict) -> Node:
    """Each group and batch reduction with its argument's level ('token' or 'response',
    dsl.levels; `level`: each node's, the objective's facts) in its node's `level`, which its
    torch text reads; the rest as it is (the other rewrites keep it)."""
    return rebuild(root, lambda n, args: Node(n.op, args, n.value, n.pos, argument_level(n, level)) if (
        n.op in OPS and OPS[n.op].over in ("group", "batch")) else None)


# what reads the current policy: a [...] factor on one of these is a boundary, not a filter
_POLICY = ("r", "pi", "logp", "log_ratio", "H", "sum_pi_sq", "pi_v", "lv")


def filters(value: Node) -> list[Node]:
    """The objective's filters: [...] factors of the whole objective whose condition does not
    involve the current policy, so they are fixed for the update and drop tokens or responses
    (IcePop's band, a sequence mask on π_old/π_rollout). A condition on π is a trust-region
    boundary instead: the update itself reaches it."""
    out, stack = [], [value]
    policy = lambda c: any(m.op == "var" and m.value in _POLICY for m in c.walk())   # noqa: E731
    while stack:
        n = stack.pop()
        if n.op == "mul":
            stack.extend(n.args)
        elif n.op in ("neg", "div"):
            stack.append(n.args[0])
        elif n.op == "select":
            stack.append(n.args[1])
            if not policy(n.args[0]):
                out.append(Node("ind", (n.args[0],)))
        elif n.op == "ind" and not policy(n):
            out.append(n)
    return out
