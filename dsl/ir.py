"""The IR: one small expression tree. What each operation means is its row in
dsl.operations; every walk over the tree (differentiating, lowering, printing) is generic
(dsl.walks, dsl.printing).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

@dataclass(frozen=True)
class Pos:
    line: int
    col: int


@dataclass(frozen=True, eq=False)
class Node:
    """One operation. A binding used twice is one shared Node, so an objective is a DAG: every
    walk visits each distinct node once, and the hash is computed once, from the children's."""
    op: str                      # 'num' | 'var' | 'param' | a key of OPS
    args: tuple = ()
    value: object = None         # Fraction for 'num', ASCII name for 'var'/'param'
    pos: Pos | None = None       # not part of equality
    # a group or batch reduction's argument level, 'token' or 'response' (dsl.levels.argument_level),
    # once the compiler has set it (core.rewrites.annotate_levels): its torch text reads it
    level: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.op, self.args, self.value, self.level)))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if self is other:
            return True
        if not isinstance(other, Node) or self._hash != other._hash:
            return False
        done, stack = set(), [(self, other)]
        while stack:        # each pair of distinct nodes compared once: linear in a DAG
            a, b = stack.pop()
            if a is b or (id(a), id(b)) in done:
                continue
            if (a._hash != b._hash or a.op != b.op or a.value != b.value or a.level != b.level
                    or len(a.args) != len(b.args)):
                return False
            done.add((id(a), id(b)))
            stack.extend(zip(a.args, b.args))
        return True

    def walk(self):
        """Each distinct sub-expression once, parents before children."""
        seen, stack = set(), [self]
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                yield n
                stack.extend(reversed(n.args))


def postorder(n: Node) -> list[Node]:
    """Each distinct sub-expression once, every node after all of its children: the order in
    which a walk that combines the children's results visits them, without recursion."""
    out, done, stack = [], set(), [(n, False)]
    while stack:
        m, expanded = stack.pop()
        if m in done:
            continue
        if expanded:
            done.add(m)
            out.append(m)
        else:
            stack.append((m, True))
            stack.extend((a, False) for a in reversed(m.args) if a not in done)
    return out


def rebuild(root: Node, fn, new: dict | None = None) -> Node:
    """root with each node m replaced by fn(m, args), `args` its children's replacements: children
    first, each distinct node once, so shared nodes stay shared. Where fn returns None, m is kept
    over the new args, with its op, value, level and position (m itself where no child changed).
    `new`, where given, is filled as it goes (node -> replacement), for an fn that reads it."""
    new = {} if new is None else new
    for m in postorder(root):
        args = tuple(new[a] for a in m.args)
        out = fn(m, args)
        if out is None:
            out = m if all(x is a for x, a in zip(args, m.args)) else Node(m.op, args, m.value, m.pos, m.level)
        new[m] = out
    return new[root]


def tree_size(n: Node) -> int:
    """The number of nodes n has written out as a tree (bindings inlined): what printing costs."""
    size: dict = {}
    for m in postorder(n):
        size[m] = 1 + sum(size[a] for a in m.args)
    return size[n]


# ---------------------------------------------------------------- builders
# Builders fold 0 and 1 so that derivatives stay as small as a person would write them.
def num(x) -> Node:
    return Node("num", value=Fraction(x))


def var(name: str) -> Node:
    return Node("var", value=name)


ZERO, ONE = num(0), num(1)


def is_num(n: Node, x=None) -> bool:
    return n.op == "num" and (x is None or n.value == x)


def add(a, b):
    if is_num(a, 0):
        return b
    if is_num(b, 0):
        return a
    return Node("add", (a, b))


def sub(a, b):
    if is_num(b, 0):
        return a
    if is_num(a, 0):
        return neg(b)
    return Node("sub", (a, b))


def neg(a):
    if is_num(a):
        return num(-a.value)
    if a.op == "neg":
        return a.args[0]
    return Node("neg", (a,))


def mul(a, b):
    if is_num(a, 0) or is_num(b, 0):
        return ZERO
    if is_num(a, 1):
        return b
    if is_num(b, 1):
        return a
    return Node("mul", (a, b))


def div(a, b):
    if is_num(a, 0):
        return ZERO
    if is_num(b, 1):
        return a
    return Node("div", (a, b))


def call(op, *args):
    return Node(op, tuple(args))


def ind(cond):
    return Node("ind", (cond,))


def power(x, y):
    if is_num(y, 1):
        return x
    if is_num(y, 0):
        return ONE
    return Node("pow", (x, y))

