"""The IR rewrites the torch code is generated from (core.codegen): the log of a built-in
probability as the log-prob tensor itself, [c]·x as select(c, x), each group and batch reduction
with its argument's level, and the objective's filters (the [...] factors that drop tokens or
responses for the whole update)."""
from __future__ import annotations

from openrlhf_drpo.lang.ir import Node, postorder
from openrlhf_drpo.lang.levels import argument_level, levels
from openrlhf_drpo.lang.operations import OPS


# log of a built-in probability is emitted as the log-prob itself: exact for tiny π
# (no exp/log round trip) and its derivative needs no division by π.
_LOG_ATOMS = {"pi": "logp", "r": "log_ratio", "mu": "anchor", "pi_old": "old", "pi_rollout": "rollout",
              "pi_ref": "ref"}


def rewrite_logs(root: Node) -> Node:
    new: dict = {}
    for n in postorder(root):     # shared nodes stay shared
        if n.op == "log" and n.args[0].op == "var" and n.args[0].value in _LOG_ATOMS:
            new[n] = Node("var", value=_LOG_ATOMS[n.args[0].value])
        else:
            new[n] = Node(n.op, tuple(new[a] for a in n.args), n.value, n.pos) if n.args else n
    return new[root]


def select_masks(root: Node) -> Node:
    """[c]·x as select(c, x): x where c holds, else 0, even where x is inf or NaN (an IS weight
    that overflowed on a token the band drops), as PolicyLoss selects its factor
    (torch.where(keep, ratio, 0)) before multiplying: [c]·k·ℓ is select(c, k)·ℓ, so autograd's
    backward through the product never meets 0·inf either."""
    new: dict = {}
    for n in postorder(root):
        args = tuple(new[a] for a in n.args)
        if n.op == "mul" and "ind" in (args[0].op, args[1].op):
            c, x = (args[0], args[1]) if args[0].op == "ind" else (args[1], args[0])
            new[n] = Node("select", (c.args[0], x), pos=n.pos)
        else:
            new[n] = Node(n.op, args, n.value, n.pos) if n.args else n
    return new[root]


def annotate_levels(root: Node) -> Node:
    """Each group and batch reduction with its argument's level ('token' or 'response',
    lang.levels) as its node's value, which its torch text reads; the rest as it is."""
    level, new = levels(root), {}
    for n in postorder(root):
        value = argument_level(n, level) if n.op in OPS and OPS[n.op].over in ("group", "batch") else n.value
        new[n] = Node(n.op, tuple(new[a] for a in n.args), value, n.pos) if n.args else n
    return new[root]


# what reads the current policy: a [...] factor on one of these is a boundary, not a filter
_POLICY = ("r", "pi", "logp", "log_ratio", "H", "sum_pi_sq")


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
