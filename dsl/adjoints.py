"""The derivative rules of min, max, clip and pow (their rows' `gradient`, below), and the
reductions' adjoint rules, named by their rows (dsl.operations: Op.adjoint): what reverse
mode (core.reverse_mode) gives a reduction's argument, in IR. A rule (n, a, x) takes the node, its
adjoint a (at each token that read it) and its argument x, and returns what x's adjoint receives at
each token: a gathered from every token that read n, spread back over the tokens n read (reverse
mode masks it: a masked token receives nothing)."""
from __future__ import annotations

from dsl.ir import ONE, ZERO, Node, add, call, div, ind, is_num, mul, num, power, sub

SEQ_LEN = Node("var", value="seq_len")


def response_sum(n, a, x):          # every token of the response read every token of it
    return Node("seq_sum", (a,))


def response_mean(n, a, x):         # ... by 1/|y|
    return Node("seq_mean", (a,))


def ties(cmp):
    """seq_max, seq_min (cmp "ge", "le"): the extreme's ties share it equally, as torch.amax's gradient."""
    def rule(n, a, x):
        tie = Node(cmp, (x, n))         # selected, not multiplied: an unpicked element's chain gets 0
        share = div(Node("seq_sum", (a,)), Node("max", (Node("seq_sum", (Node("ind", (tie,)),)), ONE)))
        return Node("select", (tie, share))
    return rule


def prefix_sum(n, a, x):            # token s was read by every unmasked t ≥ s
    return Node("suffix_sum", (a,))


def prefix_mean(n, a, x):           # ... by 1/count_t
    return Node("suffix_sum", (div(a, Node("max", (Node("prefix_sum", (ONE,)), ONE))),))


def suffix_sum(n, a, x):            # token s was read by every unmasked t ≤ s
    return Node("prefix_sum", (a,))


def turn_sum(n, a, x):              # every token of the turn read every token of it
    return Node("turn_sum", (a,))


def turn_mean(n, a, x):             # ... by 1/|turn|
    return Node("turn_mean", (a,))


def wide(over, rule):
    """group_* and batch_* (`over`): rule(n, g, x, sibling) for a token-level x, each position read
    by the same position of the group's responses, or every token by the whole batch (g = a); or a
    response-level one, each response's value read by every token of the group's or the batch's
    responses (g = its response's Σ a) and spread back over its own tokens by 1/|y| (the value is
    their mean). sibling(kind, y) is the same reduction of kind `kind` of y, at the node's level."""
    def adjoint(n, a, x):
        level = n.level
        sibling = lambda kind, y: Node(f"{over}_{kind}", (y,), level=level)     # noqa: E731
        shared = rule(n, a if level == "token" else Node("seq_sum", (a,)), x, sibling)
        return shared if level == "token" else div(shared, Node("max", (SEQ_LEN, ONE)))
    return adjoint


def total(n, g, x, sibling):        # wide sums: each element read by every member of its pool
    return sibling("sum", g)


def mean(n, g, x, sibling):
    return sibling("mean", g)


def std(n, g, x, sibling):
    # the sample std s: ∂s/∂x_i = (d_i − mean(d))/((n − 1)·s), d = x − mean(x), 0 where s = 0
    # (below two, or all equal); mean(d) is 0 in exact arithmetic, not in doubles: k equal values
    # have d_i = c − mean, all alike, and a slope of ±1/√(n(n − 1)) without it (autograd's has it)
    d = sub(x, sibling("mean", x))
    slope = div(sub(d, sibling("mean", d)), mul(sub(sibling("count", x), ONE), n))
    return Node("select", (picked(n, x), mul(slope, sibling("sum", g))))


def shared(cmp):
    """group_max, group_min (cmp "ge", "le") and the quantile's neighbours ("eq"): the elements that
    attain the statistic share the adjoint of every element that read it, equally (torch.amax's)."""
    def rule(n, g, x, sibling):
        tie = Node(cmp, (x, n))         # selected, not multiplied: an unpicked element's chain gets 0
        return Node("select", (tie, div(sibling("sum", g), Node("max", (sibling("sum", Node("ind", (tie,))), ONE)))))
    return rule


def along(rule):
    """seq_quantile and its parts: rule(n, g, x, sibling), one of wide's rules, where every token of the
    response read n (g = a) and sibling(kind, y) is that kind of reduction along the response (seq_sum)."""
    return lambda n, a, x: rule(n, a, x, lambda kind, y: Node(f"seq_{kind}", (y,)))


def quantile(n, g, x, sibling):
    # torch.quantile's lerp(v_lo, v_hi, f): (1 − f) to the lower neighbour's ties, f to the upper's
    # (where they are one value, its ties share the whole); f = q·(n − 1) − ⌊q·(n − 1)⌋; the parts are
    # the row's own (seq_qlow for seq_quantile, batch_qlow for batch_quantile)
    part = lambda k: Node(n.op.replace("quantile", f"q{k}"), (x, n.args[1]), level=n.level)      # noqa: E731
    frac, ties = part("frac"), shared("eq")
    both = add(mul(sub(ONE, frac), ties(part("low"), g, x, sibling)), mul(frac, ties(part("high"), g, x, sibling)))
    return Node("select", (picked(n, x), both))


def picked(n, x):
    """Where an element x of an order statistic n (max, min, a quantile) is one it picks with a nonzero
    weight, or of a standard deviation, one it reads with a nonzero slope (where it is not 0: two elements
    or more, not all equal): its gradient goes there only, selected (an unpicked element's own infinite
    derivative meets no 0), on every path (core.rewrites guards the plain path's argument by it too)."""
    if n.op.endswith("_std"):
        return Node("gt", (n, ZERO))
    if "quantile" not in n.op:
        return Node("eq", (x, n))
    part = lambda k: Node(n.op.replace("quantile", f"q{k}"), (x, n.args[1]), level=n.level)     # noqa: E731
    frac = part("frac")
    return Node("or", (Node("and", (Node("eq", (x, part("low"))), Node("lt", (frac, ONE)))),
                       Node("and", (Node("eq", (x, part("high"))), Node("gt", (frac, ZERO))))))


def entries(n, a, x):               # a vocabulary sum: each entry of the token's support read once
    return a


# ---------------------------------------------------------------- the operations' derivative rules
# d(node)/dr given the derivatives `d` of its arguments. π = μ·r, so dπ/dr = μ.
def d_pow(n, d):
    # y·x^(y−1)·dx + x^y·log x·dy, with torch's pow at its special points: the first 0 where y = 0 (x^0 is 1
    # for every x), the second 0 where x = 0 ≤ y (0^y is 0 or 1 whatever y). Each guard sits inside (the
    # exponent +1, the log's argument +1), so no term meets 0·inf, no lowering evaluates log 0 where it is
    # dropped, and a NaN stays NaN (it fails every comparison): one form on every path and in the analysis.
    # (An exponent of numbers and parameters alone keeps y − 1: the report's w reads β·r^(β − 1), and a
    # parameter set to 0 makes x^0, which no objective writes.)
    x, y = n.args
    exponent = num(y.value - 1) if is_num(y) else sub(y, ONE)
    if any(m.op == "var" for m in y.walk()):
        exponent = add(exponent, ind(Node("eq", (y, ZERO))))
    at_zero = Node("and", (Node("eq", (x, ZERO)), Node("ge", (y, ZERO))))
    by_y = ZERO if is_num(d[1], 0) else mul(mul(n, call("log", add(x, ind(at_zero)))), d[1])
    return add(mul(mul(y, power(x, exponent)), d[0]), by_y)


def d_extreme(n, d, better):
    # Piecewise, never Heaviside: the first argument that attains the extreme owns the
    # derivative (ties go to the earliest), the same choice torch.where makes.
    total = ZERO
    for i, (ai, di) in enumerate(zip(n.args, d)):
        if is_num(di, 0):
            continue
        conds = [Node(better[j < i], (ai, aj)) for j, aj in enumerate(n.args) if j != i]
        cond = conds[0]
        for c in conds[1:]:
            cond = Node("and", (cond, c))
        total = add(total, mul(ind(cond), di))
    return total


def d_clip(n, d):
    # clip(x, lo, hi) is min(max(x, lo), hi) in every lowering (also when lo > hi, as
    # torch.clamp), so its rule is those two rules composed.
    x, lo, hi = n.args
    m = Node("max", (x, lo))
    dm = d_extreme(m, [d[0], d[1]], {False: "ge", True: "gt"})
    return d_extreme(Node("min", (m, hi)), [dm, d[2]], {False: "le", True: "lt"})
