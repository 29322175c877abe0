"""Reverse mode: the gradient of Σ coef·ℓ per token for an objective with a sequence reduction
of the policy, where a token's derivative depends on its whole response. Each node's adjoint
reaches its arguments through its row's rule (the forward rule with a one-hot seed, so both
modes share lang.operations); a reduction's adjoint is summed over its response and spread
back over the tokens it read. coef and mf (the mask as floats) are the generated function's."""
from __future__ import annotations

from openrlhf_drpo.lang.ir import ONE, ZERO, Node, add, div, is_num, mul, postorder
from openrlhf_drpo.lang.operations import OPS, passes_no_gradient
from openrlhf_drpo.lang.walks import constant_nodes


def reverse_gradient(value: Node, seeds: dict) -> Node:
    """d(Σ coef·ℓ)/d(log π) per token, as an IR expression, in reverse mode: each node's
    adjoint goes to its arguments through its rule's partial derivatives (the forward rule
    with a one-hot seed, so both modes share OPS). A reduction's adjoint is summed over its
    response and spread back over the tokens it read: a mean by 1/n, a max to its ties."""
    constant = constant_nodes(value)
    adj: dict = {value: Node("var", value="coef")}
    mf = Node("var", value="mf")         # the float mask: masked tokens receive nothing
    for n in reversed(postorder(value)):          # parents before children
        if n not in adj or n.op in ("num", "var", "param") or n in constant:
            continue
        op, a = OPS[n.op], adj[n]
        if passes_no_gradient(n.op):
            continue
        if op.reduce:
            x = n.args[0]
            total = Node("seq_sum", (a,))
            if op.reduce == "mean":
                share = mul(mf, Node("seq_mean", (a,)))
            elif op.reduce == "sum":
                share = mul(mf, total)
            else:       # the maximum's (minimum's) ties share it equally, as torch.amax's gradient
                tie = Node("ind", (Node("ge" if op.reduce == "max" else "le", (x, n)),))
                share = mul(mul(mf, tie), div(total, Node("max", (Node("seq_sum", (tie,)), ONE))))
            contributions = [(x, share)]
        else:
            contributions = []
            for i, x in enumerate(n.args):
                if x in constant:
                    continue
                partial = op.gradient(n, [ONE if j == i else ZERO for j in range(len(n.args))])
                if not is_num(partial, 0):
                    contributions.append((x, mul(a, partial)))
        for x, c in contributions:
            adj[x] = add(adj[x], c) if x in adj else c
    total = ZERO
    for n, a in adj.items():
        if n.op == "var" and n.value in seeds:
            total = add(total, mul(a, seeds[n.value]))
    return total
