"""The operation table: one row per operation, the single place that says what it means.

Each row declares, by keyword, its printing, one lowering per consumer (SymPy for the
analysis, torch source text for the loss, Python floats, numpy text for the numeric arbiter),
its derivative (in IR, so analysis and codegen differentiate identically), and every property
the parser, the analysis and the arbiter rely on. Every property is a required keyword: a row
that leaves one out fails when this module is imported, never by quietly weakening a claim.
Every walk over the IR (dsl.walks, dsl.printing) is generic over these rows; how the torch
text is updated in place on CPU is codegen's own table (openrlhf_drpo.core.kernel_table.KERNELS).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

from dsl import adjoints as adj
from dsl.ir import ONE, ZERO, Node, add, call, div, is_num, mul, neg, num, power, sub
from dsl.uniform import BRANCHING, HELD, SPREAD, UNIFORM, declared
from dsl.lowerings import (TWO_OVER_SQRT_PI, np_erf, np_reduce, py_max, py_min, py_pow, py_sigmoid, py_sign,
                        py_softplus, torch_clip, torch_extreme, torch_select)

GRADIENTS = ("zero", "none", "reduction")     # besides a rule: see Op.gradient
# What a reduction reads besides its own token, always its unmasked tokens only:
#   "response": its response's (seq_*), broadcast back to each of them;
#   "prefix": its response's up to this token, inclusive (prefix_*); "suffix": from this token on
#             (internal: the reverse mode's adjoint of a prefix reduction);
#   "turn": its response's sharing its turn id (turn_*: a turn of a multi-turn episode);
#   "group": the responses sharing its response's group id: one value per response for a
#            response-level argument, position by position for a token-level one (dsl.levels);
#   "batch": the optimizer step's whole batch, across data-parallel ranks;
#   "vocab": the token's own vocabulary support, entry by entry (dsl.vocabulary), no other token.
OVER = ("response", "prefix", "suffix", "turn", "group", "batch", "vocab")
UNDECLARED = "undeclared"       # a reduction's property its row left out: refused when the row is built
# what a reduction row declares (dsl.uniform says what each is), and what only a group or batch one does
REDUCTION_PROPERTIES = ("reduce", "over", "uniform", "held", "adjoint")
WIDE_PROPERTIES = ("spread",)


@dataclass(frozen=True, kw_only=True)
class Op:
    """One operation. `continuous`, `branching`, `piecewise` and `gradient` are what the
    analysis's claims rest on; `exact`, `not_real` and `callable` what the parser checks;
    `compares` where the numeric arbiter looks for thresholds."""
    symbol: str                 # infix symbol or function name, as printed
    prec: int                   # binding strength for printing; 100 = function call
    arity: tuple                # (min, max) argument count; max None = any
    kind: str                   # 'num' (returns a number) or 'bool' (a condition)
    args_kind: str              # the kind its arguments must have
    callable: bool              # a user may call it by name (the rest are operators, brackets or internal)
    # The lowerings give one value wherever it is a finite double. Beyond that, torch and numpy
    # follow IEEE (inf, NaN); Python floats raise instead (ValueError, ZeroDivisionError,
    # OverflowError: log(0), 1/0, exp(1e300)); SymPy's extended reals give ±∞, zoo, NaN or a
    # complex number, have no −0, and refuse to order NaN. A row's comment names any other case.
    sympy: Callable             # (sympy module, *args) -> SymPy expression: values only (derivatives: `gradient`)
    torch: Callable             # (*argument source) -> torch source text
    py: Callable                # (*floats) -> float
    np: Callable                # (*argument names) -> numpy source text
    # the derivative: a rule (node, argument derivatives) -> Node, through which the gradient
    # passes; "zero" (sg, sign, [...]: nothing below is differentiated); "none" (a condition:
    # it only ever sits inside [...]); "reduction" (a token's derivative depends on other tokens:
    # reverse mode only, through the row's `adjoint`)
    gradient: Callable | str
    # continuous in r wherever it is defined, in the domain 0 < μ ≤ 1, 0 < π ≤ 1 (the "smooth"
    # claim is proven from these); a predicate on the node where that depends on its arguments
    continuous: bool | Callable
    branching: bool             # SymPy must settle cases where it appears (a Min, Max, Piecewise or relation)
    piecewise: bool             # lowered to Min, Max or Piecewise: a one-line weight is assembled from cases
    exact: Callable | None      # (*Fractions) -> Fraction, or None where inexact: a parameter default's exact value
    not_real: Callable | None   # (*floats) -> why a constant has no real value there, or None
    compares: Callable | None   # (*args) -> the pairs it compares: a threshold where their difference changes sign
    signature: str = ""         # how a user calls it, for a hint (callable ones)
    brackets: tuple | None = None       # printed between these instead of as symbol(...): |x|, [c]
    printed_as: Callable | None = None  # (*args) -> the Node printed in its place (an internal op)
    # a reduction ('sum', 'mean', 'max', 'min', 'std', 'count', 'quantile'; the quantile's internal
    # 'qlow', 'qhigh', 'qfrac') of the unmasked tokens `over` selects (OVER); each of its properties
    # below is declared on its row (dsl.uniform), never taken from a default: its value where every
    # element it reduces holds x ((x, n) -> Node, n the number of those elements, then its constant
    # arguments: dsl.walks.uniform_view), that n at the held point ((level, point) -> Node), and for a
    # group or batch reduction its value over a held group's differing responses (dsl.uniform.SPREAD)
    reduce: str = ""
    over: str = ""
    uniform: Callable | str = UNDECLARED
    held: Callable | str = UNDECLARED
    spread: Callable | str | None = UNDECLARED
    # a reduction's reverse-mode rule (node, its adjoint a, its argument x) -> x's adjoint per token, in
    # IR (core.reverse_mode), or "none" (a count reads no value); required: never guessed from `reduce`
    adjoint: Callable | str | None = None
    # arguments that must be constants (a number or a parameter), each in a closed range: ((index, lo, hi), ...)
    # (seq_quantile's and batch_quantile's q): the parser refuses any other, located
    constants: tuple = ()

    def __post_init__(self):
        problems = []
        if not callable(self.gradient) and self.gradient not in GRADIENTS:
            problems.append(f"gradient must be a rule or one of {GRADIENTS}")
        if (self.kind == "bool") != (self.gradient == "none"):
            problems.append("a condition, and only a condition, has gradient 'none'")
        problems += self._reduction_problems()
        if self.gradient == "reduction" and not (callable(self.adjoint) or self.adjoint == "none"):
            problems.append("a reduction declares its adjoint=: a rule (node, its adjoint a, its argument x) -> "
                            "x's adjoint per token, in IR (as seq_sum's), or 'none' where it reads no value (a count)")
        if self.gradient != "reduction" and self.adjoint is not None:
            problems.append("only a reduction has an adjoint (reverse mode runs every other row's `gradient` rule)")
        if self.callable and not self.signature:
            problems.append("a callable operation gives its signature")
        if problems:
            raise TypeError(f"operation {self.symbol!r}: " + "; ".join(problems))

    def _reduction_problems(self) -> list:
        """Each reduction property a reduction's row leaves undeclared, or another row declares, by name."""
        given = {p for p in REDUCTION_PROPERTIES + WIDE_PROPERTIES if getattr(self, p) not in ("", None, UNDECLARED)}
        given |= {"spread"} if self.spread is None else set()        # declared: reads no value (a count)
        if self.gradient != "reduction":
            extra = sorted(given - {"adjoint"})      # (the adjoint's own message below)
            return [f"only a reduction declares {', '.join(extra)}"] if extra else []
        wide = self.over in ("group", "batch")
        lacking = [p for p in REDUCTION_PROPERTIES + WIDE_PROPERTIES * wide if p not in given and p != "adjoint"]
        out = [f"a reduction declares {p}= on its row (dsl.uniform: never taken from a default)" for p in lacking]
        if self.over and self.over not in OVER:
            out.append(f"over must be one of {OVER}, not {self.over!r}")
        if "spread" in given and not wide:
            out.append("only a group or batch reduction declares spread (a held group's responses)")
        return out

    def is_continuous(self, node: Node) -> bool:
        return self.continuous(node) if callable(self.continuous) else self.continuous


# ---------------------------------------------------------------- families of rows
def _operator(symbol, prec, arity, sympy, py, torch_symbol=None, np=None, kind="num", args_kind="num", **declared):
    """An infix or prefix operator: its torch text is Python's operator, which acts
    elementwise on numpy arrays as written and on floats as `py`."""
    ts = torch_symbol or symbol
    torch = (lambda a: f"({ts}{a})") if arity == 1 else (lambda a, b: f"({a} {ts} {b})")
    return Op(symbol=symbol, prec=prec, arity=(arity, arity), kind=kind, args_kind=args_kind, callable=False,
              sympy=sympy, torch=torch, py=py, np=np or torch, **declared)


def _function(name, sympy, torch, py, np, arity=(1, 1), signature=None, **declared):
    """An operation a user calls by name, name(x)."""
    return Op(symbol=name, prec=100, arity=arity, kind="num", args_kind="num", callable=True,
              signature=signature or f"{name}(x)", sympy=sympy, torch=torch, py=py, np=np, **declared)


def _comparison(symbol, torch_symbol, sympy, py):
    """A relation between two numbers: a condition, which only ever sits inside [...], and
    a threshold where its two sides cross."""
    return _operator(symbol, 4, 2, sympy, py, torch_symbol, kind="bool", gradient="none", continuous=False,
                     branching=True, piecewise=False, exact=None, not_real=None, compares=lambda a, b: [(a, b)])


def _reduction(name, over, kind, callable=True, adjoint=None, constants=()):
    """A reduction (Op.over): it has no per-token value, so only its torch text (a call of the function
    of its name in openrlhf_drpo.core.reductions) and its value where all it reduces hold x exist. A
    group or batch reduction's torch text also takes its argument's level ('token' or 'response'), which
    core.rewrites writes into the node's value, then its constant arguments (`constants`). Its
    analysis properties are dsl.uniform's for its kind and `over`: a kind or `over` that has none
    is an error naming the row and the property (declared), here, at import."""
    def unlowered(*a):
        raise ValueError(f"{name} has no per-token value: rewrite reductions first "
                         "(dsl.walks.uniform_view) or compile them (core.codegen)")
    if over in ("group", "batch"):
        torch = lambda x, *more: (  # noqa: E731
            f"_{name}({x}, m, logp, {'group' if over == 'group' else 'pg'}, {more[-1]!r}"
            + "".join(f", {c}" for c in more[:-1]) + ")")
    elif over == "turn":
        torch = lambda x: f"_{name}({x}, m, logp, turns)"      # noqa: E731
    else:       # (then its constant arguments: seq_quantile's q)
        torch = lambda x, *more: f"_{name}({x}, m, logp" + "".join(f", {c}" for c in more) + ")"    # noqa: E731
    props = dict(uniform=declared(UNIFORM, kind, name, "uniform"), held=declared(HELD, over, name, "held"),
                 branching=declared(BRANCHING, kind, name, "branching"))
    if over in ("group", "batch"):
        props["spread"] = declared(SPREAD, kind, name, "spread")
    arity, signature = 1 + len(constants), f"{name}(x{''.join(', ' + c[3] for c in constants)})"
    return Op(symbol=name, prec=100, arity=(arity, arity), kind="num", args_kind="num", callable=callable,
              signature=signature if callable else "", constants=tuple(c[:3] for c in constants), sympy=unlowered,
              torch=torch, py=unlowered, np=unlowered,
              gradient="reduction", continuous=True, piecewise=False, exact=None, not_real=None, compares=None,
              reduce=kind, over=over, adjoint=adjoint, **props)


# the q-quantile (seq_quantile's and batch_quantile's q, a constant in [0, 1]): torch.quantile's linear interpolation
# between two order statistics, its lower and upper neighbours (internal, with the interpolation weight: its adjoint's),
# along a response (each token reads its response's) or over the batch
_QUANTILE = ((1, 0, 1, "q"),)
_QUANTILES = (("seq", "response", adj.along), ("batch", "batch", lambda rule: adj.wide("batch", rule)))


def _constant(n: Node) -> bool:
    return not any(m.op == "var" for m in n.walk())


def _along_r(n: Node) -> bool:
    return any(m.op == "var" and m.value in ("r", "pi") for m in n.walk())


def _negative_root(name):
    return lambda a: f"{name} of a negative number" if a < 0 else None


def _pow_exact(a, b):
    # integer powers only, and not too large: 2^-3 is 1/8, 2^0.5 and 10^400 are not exact here
    return a ** int(b) if b.denominator == 1 and abs(b) <= 64 and not (a == 0 and b < 0) else None


# The order of the callable rows is the order a hint lists the functions in.
OPS: dict[str, Op] = {
    "add": _operator("+", 5, 2, lambda sp, a, b: a + b, lambda a, b: a + b, gradient=lambda n, d: add(d[0], d[1]),
                     continuous=True, branching=False, piecewise=False, exact=lambda a, b: a + b, not_real=None,
                     compares=None),
    "sub": _operator("-", 5, 2, lambda sp, a, b: a - b, lambda a, b: a - b, gradient=lambda n, d: sub(d[0], d[1]),
                     continuous=True, branching=False, piecewise=False, exact=lambda a, b: a - b, not_real=None,
                     compares=None),
    "mul": _operator("*", 6, 2, lambda sp, a, b: a * b, lambda a, b: a * b,
                     gradient=lambda n, d: add(mul(d[0], n.args[1]), mul(n.args[0], d[1])),
                     continuous=True, branching=False, piecewise=False, exact=lambda a, b: a * b, not_real=None,
                     compares=None),
    # continuous only where the divisor does not vary: 1/(r − 1.3) has a pole in the domain; the
    # arbiter probes either side of the divisor's zeros (a pole 1e-9 wide in π falls between its points)
    "div": _operator("/", 6, 2, lambda sp, a, b: a / b, lambda a, b: a / b,
                     gradient=lambda n, d: sub(div(d[0], n.args[1]),
                                               div(mul(n.args[0], d[1]), Node("pow", (n.args[1], num(2))))),
                     continuous=lambda n: _constant(n.args[1]), branching=False, piecewise=False,
                     exact=lambda a, b: None if b == 0 else a / b, not_real=None, compares=lambda a, b: [(b, ZERO)]),
    "neg": _operator("-", 7, 1, lambda sp, a: -a, lambda a: -a, gradient=lambda n, d: neg(d[0]),
                     continuous=True, branching=False, piecewise=False, exact=lambda a: -a, not_real=None,
                     compares=None),
    # IEEE's 1^±∞ = 1^NaN = 1, (−1)^±∞ = 1 and x^−∞ = 0 for x < −1 are NaN in SymPy
    "pow": _operator("^", 8, 2, lambda sp, a, b: a ** b, py_pow, torch_symbol="**", gradient=adj.d_pow,
                     continuous=lambda n: n.args[1].op == "num" and n.args[1].value >= 0, branching=False,
                     piecewise=False, exact=_pow_exact, compares=None,
                     not_real=lambda a, b: "a negative base to a fractional power"
                     if a < 0 and not float(b).is_integer() else None),
    # log(π) = log(μ·r) is split into log(μ) + log(r) (both positive), so log(π) − log(μ) is log(r):
    # the analysis settles GMPO's conditions on the raw log-ratio as fast as on log(r). log has a
    # pole where its argument reaches 0 (log|r − 1.3| inside the domain): only log of r, π, μ
    # (positive in the domain) or of something that does not vary with r is continuous in r.
    "log": _function("log", lambda sp, a: sp.expand_log(sp.log(a)), lambda a: f"torch.log({a})", math.log,
                     lambda a: f"np.log({a})", gradient=lambda n, d: div(d[0], n.args[0]),
                     continuous=lambda n: n.args[0].op == "var" or not _along_r(n.args[0]), branching=False,
                     piecewise=False, exact=None, not_real=_negative_root("log"), compares=None),
    "exp": _function("exp", lambda sp, a: sp.exp(a), lambda a: f"torch.exp({a})", math.exp, lambda a: f"np.exp({a})",
                     gradient=lambda n, d: mul(n, d[0]), continuous=True, branching=False, piecewise=False,
                     exact=None, not_real=None, compares=None),
    "sqrt": _function("sqrt", lambda sp, a: sp.sqrt(a), lambda a: f"torch.sqrt({a})", math.sqrt,
                      lambda a: f"np.sqrt({a})", gradient=lambda n, d: div(d[0], mul(num(2), n)), continuous=True,
                      branching=False, piecewise=False, exact=None, not_real=_negative_root("sqrt"), compares=None),
    "abs": _function("abs", lambda sp, a: sp.Abs(a), lambda a: f"torch.abs({a})", abs, lambda a: f"np.abs({a})",
                     gradient=lambda n, d: mul(call("sign", n.args[0]), d[0]), continuous=True, branching=False,
                     piecewise=False, exact=None, not_real=None, compares=None, brackets=("|", "|")),
    # sign(NaN) is 0 in torch and Python (no comparison holds), NaN in numpy and SymPy
    "sign": _function("sign", lambda sp, a: sp.sign(a), lambda a: f"torch.sign({a})", py_sign,
                      lambda a: f"np.sign({a})", gradient="zero", continuous=False, branching=False,
                      piecewise=False, exact=None, not_real=None, compares=None),
    "erf": _function("erf", lambda sp, a: sp.erf(a), lambda a: f"torch.erf({a})", math.erf, np_erf,
                     gradient=lambda n, d: mul(call("derf", n.args[0]), d[0]), continuous=True, branching=False,
                     piecewise=False, exact=None, not_real=None, compares=None),
    # erf′(x) = 2/√π·e^(−x²), erf's derivative (not in the language: the language's π is a
    # probability, and IR numbers are exact fractions, so the constant 2/√π lives here, exact in SymPy)
    "derf": Op(symbol="erf′", prec=100, arity=(1, 1), kind="num", args_kind="num", callable=False,
               sympy=lambda sp, a: 2 / sp.sqrt(sp.pi) * sp.exp(-a**2),
               torch=lambda a: f"({TWO_OVER_SQRT_PI!r} * torch.exp(-torch.square({a})))",
               py=lambda a: TWO_OVER_SQRT_PI * math.exp(-a * a),
               np=lambda a: f"({TWO_OVER_SQRT_PI!r} * np.exp(-np.square({a})))",
               gradient=lambda n, d: mul(mul(num(-2), mul(n.args[0], n)), d[0]), continuous=True, branching=False,
               piecewise=False, exact=None, not_real=None, compares=None),
    "atan": _function("atan", lambda sp, a: sp.atan(a), lambda a: f"torch.atan({a})", math.atan,
                      lambda a: f"np.arctan({a})", gradient=lambda n, d: div(d[0], add(ONE, power(n.args[0], num(2)))),
                      continuous=True, branching=False, piecewise=False, exact=None, not_real=None, compares=None),
    # x/(1 + |x|): nan at ±inf in every lowering, as the formula is in IEEE arithmetic. In torch x itself
    # at x = 0, so that autograd's product rule never multiplies an infinite gradient from above by
    # x·sign(x) = 0 there (sqrt(softsign(H)) at H = 0: −inf, not NaN); the value is the same
    "softsign": _function("softsign", lambda sp, a: a / (1 + sp.Abs(a)),
                          lambda a: f"torch.where({a} == 0, {a}, {a} / (1.0 + torch.abs({a})))",
                          lambda a: a / (1 + abs(a)), lambda a: f"({a} / (1 + np.abs({a})))",
                          gradient=lambda n, d: div(d[0], power(add(ONE, call("abs", n.args[0])), num(2))),
                          continuous=True, branching=False, piecewise=False, exact=None, not_real=None, compares=None),
    # σ(x) = 1/(1 + e^(−x)), in (0, 1): σ(−inf) = 0, σ(0) = 1/2, σ(inf) = 1, NaN at NaN. Its rule is
    # σ(x)·σ(−x), never σ(1 − σ): 1 − σ cancels to 0 past x ≈ 37 while σ′ is still 1e-16, and SymPy
    # sees the product positive at once. Python's float is split by sign (math.exp(1000) raises).
    "sigmoid": _function("sigmoid", lambda sp, a: 1 / (1 + sp.exp(-a)), lambda a: f"torch.sigmoid({a})", py_sigmoid,
                         lambda a: f"(1 / (1 + np.exp(-({a}))))",
                         gradient=lambda n, d: mul(mul(n, call("sigmoid", neg(n.args[0]))), d[0]), continuous=True,
                         branching=False, piecewise=False, exact=None, not_real=None, compares=None),
    # tanh(±inf) = ±1; its rule is 4·σ(2x)·σ(−2x), without the cancellation of 1 − tanh²(x) (torch's
    # autograd, which is 1.2e-12 off at x = 6 and 0 past |x| ≈ 19)
    "tanh": _function("tanh", lambda sp, a: sp.tanh(a), lambda a: f"torch.tanh({a})", math.tanh,
                      lambda a: f"np.tanh({a})",
                      gradient=lambda n, d: mul(mul(num(4), mul(call("sigmoid", mul(num(2), n.args[0])),
                                                                call("sigmoid", mul(num(-2), n.args[0])))), d[0]),
                      continuous=True, branching=False, piecewise=False, exact=None, not_real=None, compares=None),
    # softplus(x) = log(1 + e^x) > 0, computed stably: log1p(e^(−|x|)) + max(x, 0) (numpy, Python), and
    # torch's softplus with its switch to x moved from x > 20 to x > 40, where e^(−x) is below x's last
    # digit; softplus(−inf) = 0, softplus(0) = log 2, softplus(inf) = inf; derivative σ(x) (1/2 at 0)
    "softplus": _function("softplus", lambda sp, a: sp.log(1 + sp.exp(a)),
                          lambda a: f"torch.nn.functional.softplus({a}, beta=1.0, threshold=40.0)", py_softplus,
                          lambda a: f"(np.log1p(np.exp(-np.abs({a}))) + np.maximum({a}, 0))",
                          gradient=lambda n, d: mul(call("sigmoid", n.args[0]), d[0]), continuous=True,
                          branching=False, piecewise=False, exact=None, not_real=None, compares=None),
    # SymPy rows give values only (derivatives come from the IR rules), unevaluated, so that
    # the analysis can settle each case's conditions itself before building any Piecewise.
    # min, max and clip are continuous, but branch: the "smooth" proof admits neither. At a NaN
    # argument numpy gives NaN; torch.where (tensor arguments) and Python's min and max keep the
    # argument that comparisons with NaN, all false, leave (torch.clamp, a constant bound, gives NaN).
    "min": _function("min", lambda sp, *a: sp.Min(*a, evaluate=False), torch_extreme("<="), py_min,
                     np_reduce("minimum"), arity=(2, None), signature="min(a, b, ...)",
                     gradient=lambda n, d: adj.d_extreme(n, d, {False: "le", True: "lt"}), continuous=True,
                     branching=True, piecewise=True, exact=None, not_real=None,
                     compares=lambda *a: list(itertools.combinations(a, 2))),
    "max": _function("max", lambda sp, *a: sp.Max(*a, evaluate=False), torch_extreme(">="), py_max,
                     np_reduce("maximum"), arity=(2, None), signature="max(a, b, ...)",
                     gradient=lambda n, d: adj.d_extreme(n, d, {False: "ge", True: "gt"}), continuous=True,
                     branching=True, piecewise=True, exact=None, not_real=None,
                     compares=lambda *a: list(itertools.combinations(a, 2))),
    "clip": _function("clip", lambda sp, x, lo, hi: sp.Min(sp.Max(x, lo, evaluate=False), hi, evaluate=False),
                      torch_clip, lambda x, lo, hi: min(max(x, lo), hi),
                      lambda x, lo, hi: f"np.minimum(np.maximum({x}, {lo}), {hi})", arity=(3, 3),
                      signature="clip(x, lo, hi)", gradient=adj.d_clip, continuous=True, branching=True,
                      piecewise=True, exact=None, not_real=None, compares=lambda x, lo, hi: [(x, lo), (x, hi)]),
    "sg": _function("sg", lambda sp, a: a, lambda a: f"({a}).detach()", lambda a: a, lambda a: a,
                    gradient="zero", continuous=True, branching=False, piecewise=False, exact=None,
                    not_real=None, compares=None),
    "ind": Op(symbol="[]", prec=100, arity=(1, 1), kind="num", args_kind="bool", callable=False,
              sympy=lambda sp, c: sp.Piecewise((1, c), (0, True), evaluate=False),
              torch=lambda c: f"({c}).to(dtype)", py=float, np=lambda c: f"np.asarray({c}, dtype=float)",
              gradient="zero", continuous=False, branching=True, piecewise=True, exact=None, not_real=None,
              compares=None, brackets=("[", "]")),
    # [c]·x as codegen writes it (core.codegen's masks; not in the language): x where c holds, else
    # 0 even where x is inf or NaN, as PolicyLoss's torch.where(keep, ratio, 0) drops them; except
    # that a condition folded to a constant multiplies by 1.0 or 0.0 (0·inf is NaN there)
    "select": Op(symbol="select", prec=100, arity=(2, 2), kind="num", args_kind="num", callable=False,
                 sympy=lambda sp, c, x: sp.Piecewise((x, c), (0, True), evaluate=False), torch=torch_select,
                 py=lambda c, x: x if c else 0.0, np=lambda c, x: f"np.where({c}, {x}, 0.0)",
                 gradient=lambda n, d: ZERO if is_num(d[1], 0) else Node("select", (n.args[0], d[1])),
                 continuous=False, branching=True, piecewise=True, exact=None, not_real=None, compares=None,
                 printed_as=lambda c, x: Node("mul", (Node("ind", (c,)), x))),
    "lt": _comparison("<", "<", lambda sp, a, b: sp.Lt(a, b, evaluate=False), lambda a, b: a < b),
    "le": _comparison("≤", "<=", lambda sp, a, b: sp.Le(a, b, evaluate=False), lambda a, b: a <= b),
    "gt": _comparison(">", ">", lambda sp, a, b: sp.Gt(a, b, evaluate=False), lambda a, b: a > b),
    "ge": _comparison("≥", ">=", lambda sp, a, b: sp.Ge(a, b, evaluate=False), lambda a, b: a >= b),
    "eq": _comparison("==", "==", lambda sp, a, b: sp.Eq(a, b, evaluate=False), lambda a, b: a == b),
    "ne": _comparison("≠", "!=", lambda sp, a, b: sp.Ne(a, b, evaluate=False), lambda a, b: a != b),
    "and": _operator("and", 2, 2, lambda sp, a, b: sp.And(a, b), lambda a, b: a and b, "&", np_reduce("logical_and"),
                     kind="bool", args_kind="bool", gradient="none", continuous=False, branching=True,
                     piecewise=False, exact=None, not_real=None, compares=None),
    "or": _operator("or", 1, 2, lambda sp, a, b: sp.Or(a, b), lambda a, b: a or b, "|", np_reduce("logical_or"),
                    kind="bool", args_kind="bool", gradient="none", continuous=False, branching=True,
                    piecewise=False, exact=None, not_real=None, compares=None),
    "not": _operator("not ", 3, 1, lambda sp, a: sp.Not(a), lambda a: not a, "~", lambda a: f"np.logical_not({a})",
                     kind="bool", args_kind="bool", gradient="none", continuous=False, branching=True,
                     piecewise=False, exact=None, not_real=None, compares=None),
    **{f"seq_{k}": _reduction(f"seq_{k}", "response", k, adjoint=adjoint) for k, adjoint in (
        ("sum", adj.response_sum), ("mean", adj.response_mean), ("max", adj.ties("ge")), ("min", adj.ties("le")))},
    # the language's third version: reductions along a response, over a prompt's group, over the batch
    **{f"prefix_{k}": _reduction(f"prefix_{k}", "prefix", k, adjoint=adjoint) for k, adjoint in (
        ("sum", adj.prefix_sum), ("mean", adj.prefix_mean))},
    # the fourth version: over the current turn of a multi-turn response (its turn id's tokens)
    "turn_sum": _reduction("turn_sum", "turn", "sum", adjoint=adj.turn_sum),
    "turn_mean": _reduction("turn_mean", "turn", "mean", adjoint=adj.turn_mean),
    **{f"{over}_{k}": _reduction(f"{over}_{k}", over, k, adjoint=adjoint) for over, k, adjoint in (
        ("group", "sum", adj.wide("group", adj.total)), ("group", "mean", adj.wide("group", adj.mean)),
        ("group", "std", adj.wide("group", adj.std)), ("group", "count", "none"),
        ("batch", "sum", adj.wide("batch", adj.total)), ("batch", "mean", adj.wide("batch", adj.mean)),
        ("batch", "count", "none"))},
    # the fourth version's order statistics: ties share the gradient (torch.amax's); a quantile's goes to its
    # two neighbours by the interpolation weights (dsl.adjoints.quantile)
    **{f"group_{k}": _reduction(f"group_{k}", "group", k, adjoint=adj.wide("group", adj.shared(cmp)))
       for k, cmp in (("max", "ge"), ("min", "le"))},
    **{f"{p}_quantile": _reduction(f"{p}_quantile", over, "quantile", adjoint=spread(adj.quantile), constants=_QUANTILE)
       for p, over, spread in _QUANTILES},
    **{f"{p}_q{k}": _reduction(f"{p}_q{k}", over, f"q{k}", callable=False, constants=_QUANTILE,
                               adjoint="none" if k == "frac" else spread(adj.shared("eq")))
       for p, over, spread in _QUANTILES for k in ("low", "high", "frac")},
    # prefix_sum's adjoint (not in the language)
    "suffix_sum": _reduction("suffix_sum", "suffix", "sum", callable=False, adjoint=adj.suffix_sum),
    # the fourth version: a sum over the token's vocabulary support, the top-k of π_ref (or a teacher)
    # or of the current policy, entry by entry (dsl.vocabulary)
    **{k: _reduction(k, "vocab", "sum", adjoint=adj.entries) for k in ("ref_topk_sum", "topk_sum")},
}

# Functions a user may call by name, with their argument counts (the rest are operators or brackets).
FUNCTIONS = {k: op.arity for k, op in OPS.items() if op.callable}
REDUCTIONS = tuple(k for k, op in OPS.items() if op.reduce)


def passes_no_gradient(op: str) -> bool:
    """sg, sign, [...], the conditions and the counts (group_count, batch_count: they read no
    value): nothing below them is differentiated."""
    return OPS[op].gradient in ("zero", "none") or OPS[op].adjoint == "none"
