"""Reverse mode: the gradient of Σ coef·ℓ per token for an objective with a reduction of the
policy, where a token's derivative depends on other tokens. Each node's adjoint reaches its
arguments through its row's rule (the forward rule with a one-hot seed, so both modes share
dsl.operations); a reduction's through its row's adjoint rule (Op.adjoint), gathered from every
token that read it and spread back over the tokens it read, masked tokens receiving nothing.
coef and mf (the mask as floats) are the generated function's."""
from __future__ import annotations

from dsl.ir import ONE, ZERO, Node, add, is_num, mul, postorder
from dsl.operations import OPS, passes_no_gradient
from dsl.walks import constant_nodes, derivative

_MF = Node("var", value="mf")       # masked tokens receive nothing


def _times(a: Node, partial: Node) -> Node:
    """a·partial, where a selected factor (select's own partial, [c]·x; an adjoint a selection gave, an
    unpicked element's; a seed the ratio clamp selects) selects the product: 0 where c fails, even
    where the other factor is not finite there (x's value dropped, an infinite derivative)."""
    for x, y in ((partial, a), (a, partial)):
        if x.op == "select":
            return Node("select", (x.args[0], _times(y, x.args[1])))
    return mul(a, partial)


def forward_gradient(value: Node, seeds: dict) -> Node:
    """derivative(value, seeds) (forward mode), where a seed select(c, s) selects its leaf's whole chain
    rather than multiplying it: 0 where c fails even where a derivative above the leaf is infinite
    (past the ratio clamp, tanh(r^r)), as autograd's clamp selects."""
    chosen = {k: s for k, s in seeds.items() if s.op != "select"}
    total = derivative(value, chosen)
    for c in dict.fromkeys(s.args[0] for s in seeds.values() if s.op == "select"):
        part = derivative(value, {k: s.args[1] for k, s in seeds.items() if s.op == "select" and s.args[0] == c})
        total = add(total, ZERO if is_num(part, 0) else Node("select", (c, part)))
    return total


def reverse_gradient(value: Node, seeds: dict) -> Node:
    """d(Σ coef·ℓ)/d(leaves) per token, as an IR expression, in reverse mode: each node's
    adjoint goes to its arguments through its rule's partial derivatives (the forward rule
    with a one-hot seed, so both modes share OPS), a reduction's through its row's adjoint rule;
    `seeds` maps each leaf to its own derivative (log π's, H's)."""
    constant = constant_nodes(value)
    adj: dict = {value: Node("var", value="coef")}
    for n in reversed(postorder(value)):          # parents before children
        if n not in adj or n.op in ("num", "var", "param") or n in constant:
            continue
        op, a = OPS[n.op], adj[n]
        if passes_no_gradient(n.op):        # (a count's adjoint is "none")
            continue
        if op.reduce:
            contributions = [(n.args[0], _times(_MF, op.adjoint(n, a, n.args[0])))]
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
            total = add(total, _times(a, seeds[n.value]))
    return total


def nesting(over: str, *roots: Node) -> int:
    """How deeply the reductions `over` (an OPS row's over: "batch") nest in `roots`, the reverse
    mode's gradients among them (a batch reduction's adjoint is another, whose argument may read
    the objective's own batch reductions): core.collectives.BatchStatistics' passes."""
    depth: dict = {}
    for root in roots:
        for n in postorder(root):
            depth[n] = max((depth[a] for a in n.args), default=0) + (n.op in OPS and OPS[n.op].over == over)
    return max((depth[r] for r in roots), default=0)
