"""Lowerings that take more than one expression to write, named by the operation rows
(dsl.operations): torch text for min, max, clip and [c]·x, numpy text for reductions of
many arguments and for erf, and Python floats that follow IEEE as torch does."""
from __future__ import annotations

import math

TWO_OVER_SQRT_PI = 2 / math.sqrt(math.pi)     # erf′(x) = 2/√π·e^(−x²)


# ---------------------------------------------------------------- torch text
def is_literal(code: str) -> bool:
    """Whether generated source text is a number (a folded constant), not a tensor."""
    try:
        float(code)
        return True
    except ValueError:
        return False


def torch_extreme(cmp):
    pick, bound = (min, "max") if cmp == "<=" else (max, "min")

    def lower(*a):
        out = a[-1]
        for x in reversed(a[:-1]):
            rest = out
            if is_literal(x) and is_literal(rest):    # clip's inner max of two constants
                out = repr(pick(float(x), float(rest)))
            elif is_literal(rest):   # one pass (where() is ~20x slower on CPU); a tie passes x's gradient
                out = f"torch.clamp({x}, {bound}={rest})"
            else:   # nested where: the first argument attaining the extreme wins, as in the IR rule
                out = f"torch.where({x} {cmp} {rest}, {x}, {rest})"
        return out
    return lower


def torch_select(c, x):
    if c in ("True", "False"):         # a condition of constants, folded
        return f"({x} * {float(c == 'True')})"
    if is_literal(x):                  # torch.where of two floats would be float32; a selection's 0 is +0
        # (docs/language.md: a division by it is x/+0), and 0·(−1) is −0: + 0.0 makes it +0
        return f"(({c}).to(dtype) * {x})" if math.copysign(1.0, float(x)) > 0 else f"(({c}).to(dtype) * {x} + 0.0)"
    return f"torch.where({c}, {x}, 0.0)"


def torch_clip(x, lo, hi):
    if is_literal(lo) and is_literal(hi):
        return f"torch.clamp({x}, {lo}, {hi})"
    # tensor bounds: min(max(x, lo), hi) with the derivative rule's tie-breaking
    return torch_extreme("<=")(torch_extreme(">=")(x, lo), hi)


# ---------------------------------------------------------------- numpy text
def np_reduce(name):
    # min/max of any number of arguments: a reduce, not nested calls, which Python's parser
    # refuses past 200 levels
    return lambda *a: f"np.{name}({a[0]}, {a[1]})" if len(a) == 2 else f"_reduce(np.{name}, ({', '.join(a)}))"


def np_erf(a):
    # numpy has no erf, and the analysis imports neither torch nor scipy: math.erf per element
    # (correctly rounded to ~1 ulp, erf(±inf) = ±1, erf(nan) = nan, as torch.erf)
    return f"np.asarray(np.frompyfunc(math.erf, 1, 1)({a}), dtype=float)"


# ---------------------------------------------------------------- Python floats
def py_min(*a):
    return min(a)


def py_max(*a):
    return max(a)


def py_pow(a, b):
    # IEEE pow, as torch and numpy: a negative base to a fractional power is NaN (Python's
    # ** would return a complex number, which no real-valued consumer can take)
    out = a ** b
    return math.nan if isinstance(out, complex) else out


def py_sign(x):
    return 1.0 if x > 0 else -1.0 if x < 0 else 0.0


def py_sigmoid(x):
    # 1/(1 + e^(−x)) split by sign, so that e^(−x) never overflows (math.exp raises)
    if x >= 0:
        return 1 / (1 + math.exp(-x))
    e = math.exp(x)
    return e / (1 + e)


def py_softplus(x):
    # log(1 + e^x) without overflow; max keeps a NaN argument (the comparison is false)
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))

