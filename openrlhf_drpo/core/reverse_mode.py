"""Reverse mode: the gradient of Σ coef·ℓ per token for an objective with a reduction of the
policy, where a token's derivative depends on other tokens. Each node's adjoint reaches its
arguments through its row's rule (the forward rule with a one-hot seed, so both modes share
lang.operations); a reduction's adjoint is gathered from every token that read it and spread back
over the tokens it read (_reduction_adjoint). coef and mf (the mask as floats) are the generated
function's."""
from __future__ import annotations

from openrlhf_drpo.lang.ir import ONE, ZERO, Node, add, div, is_num, mul, postorder, sub
from openrlhf_drpo.lang.operations import OPS, passes_no_gradient
from openrlhf_drpo.lang.walks import constant_nodes

_MF, _SEQ_LEN = Node("var", value="mf"), Node("var", value="seq_len")     # masked tokens receive nothing


def _response(n: Node, a: Node, x: Node) -> Node:
    """seq_*: the adjoint summed over the response, spread back: a mean by 1/n, a max to its ties."""
    op, total = OPS[n.op], Node("seq_sum", (a,))
    if op.reduce == "mean":
        return mul(_MF, Node("seq_mean", (a,)))
    if op.reduce == "sum":
        return mul(_MF, total)
    # the maximum's (minimum's) ties share it equally, as torch.amax's gradient
    tie = Node("ind", (Node("ge" if op.reduce == "max" else "le", (x, n)),))
    return mul(mul(_MF, tie), div(total, Node("max", (Node("seq_sum", (tie,)), ONE))))


def _prefix(n: Node, a: Node) -> Node:
    """prefix_*: token s was read by every unmasked t ≥ s (by 1/count_t for a mean)."""
    if OPS[n.op].reduce == "mean":
        a = div(a, Node("max", (Node("prefix_sum", (ONE,)), ONE)))
    return mul(_MF, Node("suffix_sum", (a,)))


def _wide(n: Node, a: Node, x: Node) -> Node:
    """group_* and batch_*, of a token-level x (each position read by the same position of the
    group's responses, or by every token of the batch) or a response-level one (each response's
    value read by every token of the group's or the batch's responses, and spread back over its
    own tokens by 1/|y|: the value is their mean)."""
    op, level = OPS[n.op], n.value
    over = lambda kind, y: Node(f"{op.over}_{kind}", (y,), value=level)     # noqa: E731
    gathered = a if level == "token" else Node("seq_sum", (a,))
    if op.reduce == "sum":
        adjoint = over("sum", gathered)
    elif op.reduce == "mean":
        adjoint = over("mean", gathered)
    else:   # the sample std s: ∂s/∂x_i = (d_i − mean(d))/((n − 1)·s), d = x − mean(x), 0 where s = 0
        # (below two, or all equal); mean(d) is 0 in exact arithmetic, not in doubles: k equal values
        # have d_i = c − mean, all alike, and a slope of ±1/√(n(n − 1)) without it (autograd's has it)
        d = sub(x, over("mean", x))
        slope = div(sub(d, over("mean", d)), mul(sub(over("count", x), ONE), n))
        adjoint = Node("select", (Node("gt", (n, ZERO)), mul(slope, over("sum", gathered))))
    if level == "token":
        return mul(_MF, adjoint)
    return mul(_MF, div(adjoint, Node("max", (_SEQ_LEN, ONE))))


def _reduction_adjoint(n: Node, a: Node) -> Node | None:
    """The contribution to the adjoint of n's argument, given n's adjoint a (None: a count, which
    reads no value)."""
    op, x = OPS[n.op], n.args[0]
    if op.reduce == "count":
        return None
    if op.over == "response":
        return _response(n, a, x)
    if op.over == "prefix":
        return _prefix(n, a)
    return _wide(n, a, x)


def _times(a: Node, partial: Node) -> Node:
    """a·partial, where a selected partial (select's own: [c]·x) selects the product: 0 where c
    fails even where the adjoint a is not finite there (x's value dropped, inf or NaN)."""
    if partial.op == "select":
        return Node("select", (partial.args[0], _times(a, partial.args[1])))
    return mul(a, partial)


def reverse_gradient(value: Node, seeds: dict) -> Node:
    """d(Σ coef·ℓ)/d(leaves) per token, as an IR expression, in reverse mode: each node's
    adjoint goes to its arguments through its rule's partial derivatives (the forward rule
    with a one-hot seed, so both modes share OPS), a reduction's through _reduction_adjoint;
    `seeds` maps each leaf to its own derivative (log π's, H's)."""
    constant = constant_nodes(value)
    adj: dict = {value: Node("var", value="coef")}
    for n in reversed(postorder(value)):          # parents before children
        if n not in adj or n.op in ("num", "var", "param") or n in constant:
            continue
        op, a = OPS[n.op], adj[n]
        if passes_no_gradient(n.op):
            continue
        if op.reduce:
            share = _reduction_adjoint(n, a)
            contributions = [] if share is None else [(n.args[0], share)]
        else:
            contributions = []
            for i, x in enumerate(n.args):
                if x in constant:
                    continue
                partial = op.gradient(n, [ONE if j == i else ZERO for j in range(len(n.args))])
                if not is_num(partial, 0):
                    contributions.append((x, _times(a, partial)))
        for x, c in contributions:
            adj[x] = add(adj[x], c) if x in adj else c
    total = ZERO
    for n, a in adj.items():
        if n.op == "var" and n.value in seeds:
            total = add(total, mul(a, seeds[n.value]))
    return total
