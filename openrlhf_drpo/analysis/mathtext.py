"""Formulas and numbers as the analysis writes them: one-line Unicode math for a SymPy
expression (never SymPy's own calls), and a number to 6 significant digits. A leaf: the
engine writes formulas into its notes with it, the JSON's text and the report print with it."""
from __future__ import annotations

import re
from decimal import Decimal

from dsl.names import display_name

_FUNCS = {"Piecewise", "sign", "Abs", "log", "exp", "sqrt", "Min", "Max", "Eq", "LambertW", "True", "False"}


def _decimal(m):
    p, q = int(m.group(1)), int(m.group(2))
    d = q
    for f in (2, 5):
        while d % f == 0:
            d //= f
    return f"{p / q:g}" if d == 1 else m.group(0)


def math_text(e, weight: bool = False) -> str:
    """One-line Unicode math: 1 − 0.08·μ·(r − 1), with Piecewise as 'x if c; y otherwise'.
    A weight puts its constant first (1 − ...); a boundary keeps μ + 12.5, as the paper does."""
    import sympy as sp
    if isinstance(e, sp.Piecewise):
        # a nested Piecewise keeps its own brackets: (0 if r > 1.2; 1 otherwise) if A > 0 and r > 1
        inner = lambda x: f"({math_text(x, weight)})" if x.has(sp.Piecewise) else math_text(x, weight)  # noqa: E731
        parts = [f"{inner(x)} if {math_text(c)}" for x, c in e.args[:-1]]
        return "; ".join(parts + [f"{inner(e.args[-1][0])} otherwise"])
    if isinstance(e, (sp.Eq, sp.Ne)):
        return f"{math_text(e.lhs)} {'=' if isinstance(e, sp.Eq) else '≠'} {math_text(e.rhs)}"
    if isinstance(e, sp.Basic) and not isinstance(e, sp.logic.boolalg.Boolean) and e.has(sp.Piecewise):
        lifted = _lift(sp, e)      # 2·Piecewise(...) or exp(Piecewise(...)) printed as cases
        if lifted is not None:
            return math_text(lifted, weight)
    e = _without_pi(sp, e)
    # whatever SymPy prints as a call (Piecewise deep inside, Eq and Ne inside a condition)
    # is printed as math in its place: a placeholder symbol stands for it in sstr's text
    spots = {}
    if isinstance(e, sp.Basic):
        calls = sorted(e.atoms(sp.Piecewise, sp.Eq, sp.Ne), key=sp.default_sort_key)
        spots = {f"Spot{k}x": f"({math_text(x)})" for k, x in enumerate(calls)}
        if spots:
            e = e.xreplace({x: sp.Symbol(name) for x, name in zip(calls, spots)})
    text = sp.sstr(e)
    if weight and isinstance(e, sp.Add):   # the constant first: 1 − 0.08·μ·(r − 1)
        const, rest = e.as_coeff_Add()
        if const != 0 and not rest.is_number:
            tail = sp.sstr(rest)
            text = f"{sp.sstr(const)} - {tail[1:]}" if tail.startswith("-") else f"{sp.sstr(const)} + {tail}"
    # p/q alone, never an exponent's tail: r**2/400 is r²/400, not r^0.005
    text = re.sub(r"(?<![\w.)*])(\d+)/(\d+)(?![\w.(])", _decimal, text)
    text = re.sub(r"(?<![\w.])\d{16,}(?![\w.])", lambda m: f"{Decimal(m.group(0)).normalize():.6g}", text)   # 1e+300, not 301 digits
    text = text.replace("**", "^").replace("*", "·").replace(" - ", " − ").replace("<=", "≤").replace(">=", "≥")
    text = text.replace(" & ", " and ").replace(" | ", " or ").replace("~", "not ")
    text = re.sub(r"\b([A-Za-z][A-Za-z0-9_]*)\b",
                  lambda m: m.group(1) if m.group(1) in _FUNCS else display_name(m.group(1)), text)
    for name, shown in spots.items():
        text = text.replace(name, shown)
    return text.replace("Abs", "abs").replace("Min(", "min(").replace("Max(", "max(")


LIFT_PIECES = 32    # cases a lifted formula may have; past it, each Piecewise is printed in brackets in place


def _lift(sp, e):
    """e with its Piecewise lifted to the top, first match winning as in a Piecewise:
    2·(1 if c; 0 otherwise) is (2 if c; 0 otherwise). None past LIFT_PIECES cases."""
    found = [x for x in e.atoms(sp.Piecewise) if not any(x != y and y.has(x) for y in e.atoms(sp.Piecewise))]
    count = 1
    for x in found:
        count *= len(x.args)
    if count > LIFT_PIECES or isinstance(e, sp.Piecewise):
        return None
    P = min(found, key=sp.default_sort_key)
    return sp.Piecewise(*[(e.xreplace({P: x}), c) for x, c in P.args])


def _without_pi(sp, e):
    """SymPy's constant π (erf's derivative is 2/√π·e^(−x²)) as a 6-digit decimal: printed as
    'pi', it would read as the language's π, the probability."""
    if not isinstance(e, sp.Basic) or not e.has(sp.pi):
        return e
    if e.is_number:
        v = float(f"{float(e):.6g}")
        return sp.Integer(int(v)) if v.is_integer() else sp.Float(v, 6)
    if e.is_Mul:            # the numeric factors as one decimal: 1.12838·exp(−(r − 1)²)
        coeff, rest = e.as_independent(*e.free_symbols)
        return _without_pi(sp, coeff) * e.func(*[_without_pi(sp, a) for a in sp.Mul.make_args(rest)])
    return e.func(*[_without_pi(sp, a) for a in e.args])


def fmt(x) -> str:
    return "unbounded" if x is None else f"{float(x):.6g}"


REPORT_WIDTH = 2000    # characters of one formula in the text report; --json has it whole


def clip_text(text: str) -> str:
    return text if len(text) <= REPORT_WIDTH else text[:REPORT_WIDTH] + f"… ({len(text):,} characters; --json has it whole)"


def magnitudes(values) -> str:
    """|A| values as printed, each once: both sides of a threshold (2 ± 2e-6) read 2."""
    return ", ".join(dict.fromkeys(f"{m:g}" for m in values))
