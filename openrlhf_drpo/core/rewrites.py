"""The IR rewrites the torch code is generated from (core.codegen): the log of a built-in
probability as the log-prob tensor itself, [c]·x as select(c, x), each group and batch reduction
with its argument's level, and the objective's filters (the [...] factors that drop tokens or
responses for the whole update)."""
from __future__ import annotations

from openrlhf_drpo.lang.ir import ONE, Node, div, mul, neg, postorder
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
    that overflowed on a token the band drops). A select is lifted out of the product, negation
    or quotient it is a factor of ([c]·k·ℓ is select(c, k·ℓ)), so that a non-finite ℓ never
    meets 0 either; where c holds the product is the one written, in its order."""
    new: dict = {}
    for n in postorder(root):
        args = tuple(new[a] for a in n.args)
        new[n] = _lifted(n.op, args) if n.op in _LIFTS else Node(n.op, args, n.value, n.pos) if n.args else n
    return new[root]


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
    `where` (forward mode's rule select(c, dx) needs none). Where c holds every value is unchanged;
    where it fails x's is dropped by its select."""
    reads: set = set()
    for n in postorder(root):
        if (n.op == "var" and n.value in _POLICY) or (n.op in OPS and OPS[n.op].gradient not in ("zero", "none")
                                                       and any(a in reads for a in n.args)):
            reads.add(n)
    memo: dict = {}

    def walk(n: Node, c):     # c: the condition of the selects n sits under, up to a reduction (None: none)
        if n not in reads:
            return n
        if (n, c) not in memo:
            if not n.args:
                out = n
            elif n.op == "select":
                out = Node("select", (n.args[0], walk(n.args[1], n.args[0] if c is None else Node("and", (c, n.args[0])))))
            elif OPS[n.op].reduce:
                out = Node(n.op, (walk(n.args[0], None),), n.value, n.pos)
            else:
                out = Node(n.op, tuple(walk(a, c) for a in n.args), n.value, n.pos)
            memo[n, c] = out if c is None or (n.args and not OPS[n.op].reduce) else Node("select", (c, out))
        return memo[n, c]
    return walk(root, None)


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
