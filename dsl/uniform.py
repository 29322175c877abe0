"""What a reduction row declares for the analysis (dsl.operations' rows take it from here, by name):
its value where every element it reduces holds x (`uniform`), how many elements it reduces at
the held point (`held`), its value over a held group whose responses differ (`spread`) and
whether SymPy must settle cases for it (`branching`). Each table is keyed by the row's `reduce`
kind or `over`, and a key it lacks is an error naming the row and the property (declared), never
a guess: a new seq_prod would otherwise be read as its argument, a new `over` as the batch."""
from __future__ import annotations

import math

from dsl.ir import ONE, ZERO, Node, add, div, mul, num, power, sub


def declared(table: dict, key: str, row: str, prop: str):
    """table[key], or an error naming the row, the property and the key it has no entry for."""
    if key not in table:
        raise TypeError(f"operation {row!r}: no {prop} is declared for {key!r} (known: {sorted(table)}); "
                        f"declare {prop}= on its row")
    return table[key]


# ---------------------------------------------------------------- the value where all n elements hold x
def _total(x, n, *constants):
    return mul(n, x)


def _same(x, n, *constants):       # a mean, an extreme or a quantile of n copies of x
    return x


def _no_spread(x, n, *constants):  # the sample std of n equal values
    return ZERO


def _count(x, n, *constants):
    return n


def _quantile_frac(x, n, q):
    """The quantile's weight q·(n − 1) − ⌊q·(n − 1)⌋ over n elements, where n and q are numbers (the
    reverse mode's internal row; no objective reads it, and the IR has no ⌊⌋ for a symbolic n)."""
    def exact(m):
        if m.op == "num":
            return m.value
        if m.op not in _ARITHMETIC:
            raise ValueError(f"the quantile's interpolation weight needs numbers, got {m.op}")
        return _ARITHMETIC[m.op](*map(exact, m.args))
    rank = exact(q) * (exact(n) - 1)
    return num(rank - math.floor(rank))


_ARITHMETIC = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
               "div": lambda a, b: a / b, "neg": lambda a: -a}
UNIFORM = {"sum": _total, "mean": _same, "max": _same, "min": _same, "std": _no_spread, "count": _count,
           "quantile": _same, "qlow": _same, "qhigh": _same, "qfrac": _quantile_frac}
# the rest pick elements by comparing them: SymPy settles cases
BRANCHING = {"sum": False, "mean": False, "std": False, "count": False, "qfrac": False,
             "max": True, "min": True, "quantile": True, "qlow": True, "qhigh": True}


# ---------------------------------------------------------------- how many elements, at the held point
# `point`: dsl.walks.uniform_view's parameters seq_len |y|, position p, group_size G and batch_size N, as Nodes
def _vocab(level, point):
    raise ValueError("a vocabulary sum has no uniform view over tokens (dsl.vocabulary.refuse_r_analysis)")


# its response's |y| tokens, and its turn's (the uniform response is one turn); a prefix at position
# p its first p, a suffix its last |y| − p + 1; a group its G responses, position by position too;
# the batch its N responses, or their N·|y| tokens
HELD = {"response": lambda level, point: point["seq_len"], "turn": lambda level, point: point["seq_len"],
        "prefix": lambda level, point: point["position"],
        "suffix": lambda level, point: add(sub(point["seq_len"], point["position"]), ONE),
        "group": lambda level, point: point["group_size"],
        "batch": lambda level, point: mul(point["batch_size"], point["seq_len"]) if level == "token"
        else point["batch_size"],
        "vocab": _vocab}


# ---------------------------------------------------------------- the value over a held group's responses
# A group or batch reduction's value over n elements that hold the values xs [(x, share)] in those
# shares (analysis.batch.held's held group; shares sum to 1). A string: not derived (why); None: the row
# reads no value (a count), its uniform value holds.
def _mean_of(xs):
    out = None
    for x, share in xs:
        out = mul(num(share), x) if out is None else add(out, mul(num(share), x))
    return out


def _extreme(kind):
    def spread(xs, n):
        values = tuple(dict.fromkeys(x for x, _ in xs))
        return values[0] if len(values) == 1 else Node(kind, values)
    return spread


def _sample_std(xs, n):
    mean = _mean_of(xs)
    return Node("sqrt", (mul(div(n, sub(n, ONE)), _mean_of([(power(sub(x, mean), num(2)), s) for x, s in xs])),))


SPREAD = {"sum": lambda xs, n: mul(n, _mean_of(xs)), "mean": lambda xs, n: _mean_of(xs), "std": _sample_std,
          "max": _extreme("max"), "min": _extreme("min"), "count": None,
          "quantile": "its neighbours' ranks depend on N and on A's sign",
          "qlow": "an internal row of the quantile's adjoint", "qhigh": "an internal row of the quantile's adjoint",
          "qfrac": "an internal row of the quantile's adjoint"}
