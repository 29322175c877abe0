"""The IR as text: canonical Unicode with only the parentheses precedence requires, each
operation printed as its row (dsl.operations) says."""
from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction

from dsl.ir import Node, tree_size
from dsl.names import display_name
from dsl.operations import OPS

RENDER_LIMIT = 4000     # operations: past this, inlined text is abbreviated (chained bindings grow it 2^n)


def render(n: Node, names: dict | None = None) -> str:
    """Canonical Unicode text, with only the parentheses precedence requires. `names` maps
    shared nodes to their binding names, printed instead of the node (except n itself);
    without it, an expression longer than RENDER_LIMIT operations is abbreviated."""
    if names is None and (size := tree_size(n)) > RENDER_LIMIT:
        return f"(an expression of {size:,} operations written out)"
    return _render(n, 0, names or {}, n)


def _render(n: Node, parent_prec: int, names: dict, top: Node) -> str:
    if n in names and n is not top:
        return display_name(names[n])
    if n.op == "num":
        return _render_number(n.value)
    if n.op in ("var", "param"):
        return display_name(n.value)
    op = OPS[n.op]
    sub = lambda a, prec=0: _render(a, prec, names, top)    # noqa: E731
    if op.printed_as:
        return _render(op.printed_as(*n.args), parent_prec, names, top)
    if op.brackets:
        return op.brackets[0] + sub(n.args[0]) + op.brackets[1]
    if op.prec == 100:
        return op.symbol + "(" + ", ".join(sub(a) for a in n.args) + ")"
    if len(n.args) == 1:
        text = op.symbol + sub(n.args[0], op.prec)
    elif n.op == "pow":   # right-associative
        text = sub(n.args[0], op.prec + 1) + "^" + sub(n.args[1], op.prec)
    else:
        # operators are left-associative: a right operand of equal precedence keeps its
        # parentheses, so the canonical text parses back to the same tree
        text = sub(n.args[0], op.prec) + f" {op.symbol} " + sub(n.args[1], op.prec + 1)
    return f"({text})" if op.prec < parent_prec else text


def _render_number(v: Fraction) -> str:
    """The shortest text that parses back to exactly v: 12, 0.2, 1e-400 (never 400 digits)."""
    if v.denominator == 1 and abs(v.numerator) < 10**15:
        return str(v.numerator)
    f = float(v)
    if f != 0 and math.isfinite(f) and Fraction(repr(f)) == v:
        return repr(f)
    q, twos, fives = v.denominator, 0, 0
    while q % 2 == 0:
        q, twos = q // 2, twos + 1
    while q % 5 == 0:
        q, fives = q // 5, fives + 1
    if q == 1:      # a finite decimal: exact in scientific notation
        n = max(twos, fives)
        return f"{Decimal(v.numerator * 10**n // v.denominator).scaleb(-n).normalize():e}".replace("e+", "e")
    return f"{v.numerator}/{v.denominator}"
