"""The IR: one small expression tree, and one table that says what every operation means.

Each row of OPS declares, in one place, an operation's SymPy lowering, its torch
lowering (source text), its numeric lowerings (Python floats, and numpy arrays for the
analysis's numeric arbiter), its derivative rule
(in IR, so analysis and codegen differentiate identically) and how it is printed.
Everything else (printing, differentiation, lowering) is one generic walk over rows.
"""
from __future__ import annotations

from decimal import Decimal
import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable


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

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.op, self.args, self.value)))

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
            if a._hash != b._hash or a.op != b.op or a.value != b.value or len(a.args) != len(b.args):
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


def constant_nodes(*roots: Node) -> set:
    """The sub-expressions without r, π, μ or A (variables), each found once. A sequence
    reduction is never constant: seq_mean(2) is 2, or 0 on an empty response."""
    out = set()
    for root in roots:
        for n in postorder(root):
            if n.op != "var" and not (n.op in OPS and OPS[n.op].reduce) and all(a in out for a in n.args):
                out.add(n)
    return out


def tree_size(n: Node) -> int:
    """The number of nodes n has written out as a tree (bindings inlined): what printing costs."""
    size: dict = {}
    for m in postorder(n):
        size[m] = 1 + sum(size[a] for a in m.args)
    return size[n]


# ---------------------------------------------------------------- names
# Canonical names are ASCII; Unicode is for display. λ is 'lam' so the name stays a
# valid Python/SymPy identifier in generated code and in `sympify`-able output.
GREEK = {
    "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "eps": "ε", "zeta": "ζ",
    "eta": "η", "theta": "θ", "iota": "ι", "kappa": "κ", "lam": "λ", "mu": "μ", "nu": "ν",
    "xi": "ξ", "omicron": "ο", "pi": "π", "rho": "ρ", "sigma": "σ", "tau": "τ",
    "upsilon": "υ", "phi": "φ", "chi": "χ", "psi": "ψ", "omega": "ω",
    "Gamma": "Γ", "Delta": "Δ", "Theta": "Θ", "Lambda": "Λ", "Xi": "Ξ", "Pi": "Π",
    "Sigma": "Σ", "Phi": "Φ", "Psi": "Ψ", "Omega": "Ω",
}
_ALIASES = {"epsilon": "eps", "lambda": "lam", "ς": "sigma"}
_TO_ASCII = {**{u: a for a, u in GREEK.items()}, **_ALIASES}

BUILTINS = {
    "r": "the importance ratio π/μ",
    "pi": "the current probability of the sampled token",
    "mu": "the behaviour probability of the sampled token",
    "A": "the advantage",
    # the two probabilities μ can be (@anchor picks which one μ is), each nameable on its own
    "pi_old": "the trainer's recomputed old (proximal) probability of the sampled token",
    "pi_rollout": "the rollout engine's (vLLM's) probability of the sampled token",
    "seq_len": "the number of unmasked tokens in this response",
}
# the policies that are constants during an update, and the name of the log-prob tensor
# ObjectiveLoss receives for each
OTHER_POLICIES = {"pi_old": "old_log_probs", "pi_rollout": "rollout_log_probs"}


def canonical_name(raw: str) -> str:
    """`ε_high`, `eps_high` and `epsilon_high` are one name: `eps_high`."""
    return "_".join(_TO_ASCII.get(part, part) for part in raw.split("_"))


def display_name(name: str) -> str:
    return "_".join(GREEK.get(part, part) for part in name.split("_"))


# ---------------------------------------------------------------- builders
# Builders fold 0 and 1 so that derivatives stay as small as a person would write them.
def num(x) -> Node:
    return Node("num", value=Fraction(x))


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


# ---------------------------------------------------------------- derivative rules
# d(node)/dr given the derivatives `d` of its arguments. π = μ·r, so dπ/dr = μ.
def power(x, y):
    if is_num(y, 1):
        return x
    if is_num(y, 0):
        return ONE
    return Node("pow", (x, y))


def _d_pow(n, d):
    x, y = n.args
    if is_num(d[1], 0):  # x^c: c·x^(c-1)·dx
        exponent = num(y.value - 1) if is_num(y) else sub(y, ONE)
        return mul(mul(y, power(x, exponent)), d[0])
    return mul(n, add(mul(d[1], call("log", x)), div(mul(y, d[0]), x)))


def _d_extreme(n, d, better):
    # Piecewise, never Heaviside: the first argument that attains the extreme owns the
    # derivative (ties go to the earliest), the same choice torch.where makes.
    total = ZERO
    for i, (ai, di) in enumerate(zip(n.args, d)):
        if is_num(di, 0):
            continue
        conds = [Node(better[j < i], (ai, aj)) for j, aj in enumerate(n.args) if j != i]
        cond = conds[0]
        for c in conds[1:]:
            cond = Node("and", (cond, c))
        total = add(total, mul(ind(cond), di))
    return total


def _d_clip(n, d):
    # clip(x, lo, hi) is min(max(x, lo), hi) in every lowering (also when lo > hi, as
    # torch.clamp), so its rule is those two rules composed.
    x, lo, hi = n.args
    m = Node("max", (x, lo))
    dm = _d_extreme(m, [d[0], d[1]], {False: "ge", True: "gt"})
    return _d_extreme(Node("min", (m, hi)), [dm, d[2]], {False: "le", True: "lt"})


def _zero(n, d):
    return ZERO


NOT_DIFFERENTIABLE = "boolean"   # conditions only ever sit inside [...] whose derivative is 0


def passes_no_gradient(op: str) -> bool:
    """sg, sign, [...] and the conditions: nothing below them is differentiated."""
    return OPS[op].deriv is NOT_DIFFERENTIABLE or OPS[op].deriv is _zero
REDUCTION = "reduction"          # a token's derivative depends on its whole response: reverse mode only


# ---------------------------------------------------------------- torch lowering helpers
def _is_literal(code: str) -> bool:
    try:
        float(code)
        return True
    except ValueError:
        return False


def _t_where_extreme(cmp):
    pick, bound = (min, "max") if cmp == "<=" else (max, "min")

    def lower(*a):
        out = a[-1]
        for x in reversed(a[:-1]):
            rest = out
            if _is_literal(x) and _is_literal(rest):    # clip's inner max of two constants
                out = repr(pick(float(x), float(rest)))
            elif _is_literal(rest):   # one pass (where() is ~20x slower on CPU); a tie passes x's gradient
                out = f"torch.clamp({x}, {bound}={rest})"
            else:   # nested where: the first argument attaining the extreme wins, as in the IR rule
                out = f"torch.where({x} {cmp} {rest}, {x}, {rest})"
        return out
    return lower


_MIRROR = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}


def _f_cmp(name):
    def lower(a, b):
        if _is_literal(a[0]) or (b[1] and not a[1]):     # the tensor (a fresh one, if any) goes first
            a, b, name_ = b, a, _MIRROR[name]
        else:
            name_ = name
        if a[1]:
            return f"{a[0]}.{name_}_({b[0]})", True
        return f"torch.{name_}({a[0]}, {b[0]}, out=torch.empty_like(logp))", True
    return lower


def _f_fresh_first(a, b):
    return (b, a) if b[1] and not a[1] else (a, b)


def _f_and(a, b):
    a, b = _f_fresh_first(a, b)
    return (f"{a[0]}.mul_({b[0]})" if a[1] else f"({a[0]} * {b[0]})"), True


def _f_or(a, b):       # 0/1 values: a + b, clamped to 1
    a, b = _f_fresh_first(a, b)
    return (f"{a[0]}.add_({b[0]})" if a[1] else f"({a[0]} + {b[0]})") + ".clamp_(max=1.0)", True


def _f_not(a):
    return (f"{a[0]}.neg_().add_(1.0)" if a[1] else f"(1.0 - {a[0]})"), True


def _t_select(c, x):
    if c in ("True", "False"):         # a condition of constants, folded
        return f"({x} * {float(c == 'True')})"
    if _is_literal(x):                  # torch.where of two floats would be float32
        return f"(({c}).to(dtype) * {x})"
    return f"torch.where({c}, {x}, 0.0)"


def _t_clip(x, lo, hi):
    if _is_literal(lo) and _is_literal(hi):
        return f"torch.clamp({x}, {lo}, {hi})"
    # tensor bounds: min(max(x, lo), hi) with the derivative rule's tie-breaking
    return _t_where_extreme("<=")(_t_where_extreme(">=")(x, lo), hi)


@dataclass(frozen=True)
class Op:
    arity: tuple[int, int]          # (min, max) argument count; max None = any
    kind: str                       # 'num' (returns a number) or 'bool'
    args_kind: str                  # kind its arguments must have
    sympy: Callable                 # (sympy_module, *args) -> sympy expr
    torch: Callable                 # (*arg_source) -> torch source text
    py: Callable                    # (*floats) -> float
    np: Callable                    # (*arg names) -> numpy source text (numpy_plan), IEEE like torch: nan, not an error
    deriv: Callable | str           # (node, arg_derivatives) -> Node
    prec: int                       # binding strength for printing; 100 = function call
    symbol: str                     # infix symbol or function name
    reuses_args: bool = False       # the torch text names an argument twice: bind it first
    inplace: str = ""               # torch method updating its first argument in place (add_, ...)
    # how a fresh second argument is updated in place, bit for bit ((a, b) -> source), if it can be
    inplace_second: Callable | None = None
    # the eager kernel's lowering of a boolean op, with booleans as 0/1 floats (comparisons
    # into a float tensor are ~4x faster on CPU than into bool): ((code, fresh), ...) -> (code, fresh)
    floats: Callable | None = None
    # a reduction over the unmasked tokens of one response ('sum', 'mean', 'max', 'min'); its
    # value is broadcast back to every token, and its derivative is taken in reverse mode
    reduce: str = ""
    # a reduction's value on a response whose tokens all hold x ((x, |y|) -> Node): the analysis
    # studies a sequence objective there (dsl.ir.uniform_view)
    uniform: Callable | None = None


def _infix(sym, prec, sympy, py, deriv, torch_sym=None, kind="num", args_kind="num", arity=2, inplace="",
           inplace_second=None, np=None, floats=None):
    ts = torch_sym or sym
    if arity == 1:
        torch = lambda a: f"({ts}{a})"
    else:
        torch = lambda a, b: f"({a} {ts} {b})"
    # arithmetic and comparison operators act elementwise on numpy arrays as written: torch's
    # text is Python's operator, the same on arrays and floats as `py`
    return Op((arity, arity), kind, args_kind, sympy, torch, py, np or torch, deriv, prec, sym, inplace=inplace,
              inplace_second=inplace_second, floats=floats)


def _fn(name, sympy, torch, py, np, deriv, arity=(1, 1), kind="num", args_kind="num", reuses_args=False, inplace=""):
    return Op(arity, kind, args_kind, sympy, torch, py, np, deriv, 100, name, reuses_args, inplace=inplace)


def _cmp(name, sym, torch_sym, sympy, py):
    return _infix(sym, 4, sympy, py, NOT_DIFFERENTIABLE, torch_sym, kind="bool", floats=_f_cmp(name))


def _seq(kind):
    def unlowered(*a):
        raise ValueError(f"seq_{kind} has no per-token value: rewrite sequence reductions first "
                         "(dsl.ir.uniform_view) or compile them (dsl.codegen)")
    uniform = (lambda x, n: mul(n, x)) if kind == "sum" else (lambda x, n: x)
    return Op((1, 1), "num", "num", unlowered, lambda x: f"_seq_{kind}({x}, m, logp)", unlowered,
              unlowered, REDUCTION, 100, f"seq_{kind}", reduce=kind, uniform=uniform)


def _np_reduce(name):
    # min/max of any number of arguments: a reduce, not nested calls, which Python's parser
    # refuses past 200 levels
    return lambda *a: f"np.{name}({a[0]}, {a[1]})" if len(a) == 2 else f"_reduce(np.{name}, ({', '.join(a)}))"


def _pymin(*a):
    return min(a)


def _pymax(*a):
    return max(a)


def _py_pow(a, b):
    # IEEE pow, as torch and numpy: a negative base to a fractional power is NaN (Python's
    # ** would return a complex number, which no real-valued consumer can take)
    out = a ** b
    return math.nan if isinstance(out, complex) else out


def _sign(x):
    return 1.0 if x > 0 else -1.0 if x < 0 else 0.0


def _np_erf(a):
    # numpy has no erf, and the analysis imports neither torch nor scipy: math.erf per element
    # (correctly rounded to ~1 ulp, erf(±inf) = ±1, erf(nan) = nan, as torch.erf)
    return f"np.asarray(np.frompyfunc(math.erf, 1, 1)({a}), dtype=float)"


_TWO_OVER_SQRT_PI = 2 / math.sqrt(math.pi)


OPS: dict[str, Op] = {
    "add": _infix("+", 5, lambda sp, a, b: a + b, lambda a, b: a + b,
                  lambda n, d: add(d[0], d[1]), inplace="add_", inplace_second=lambda a, b: f"{b}.add_({a})"),
    "sub": _infix("-", 5, lambda sp, a, b: a - b, lambda a, b: a - b,
                  lambda n, d: sub(d[0], d[1]), inplace="sub_",
                  inplace_second=lambda a, b: f"{b}.neg_().add_({a})"),    # IEEE: a - b is a + (-b)
    "mul": _infix("*", 6, lambda sp, a, b: a * b, lambda a, b: a * b,
                  lambda n, d: add(mul(d[0], n.args[1]), mul(n.args[0], d[1])), inplace="mul_",
                  inplace_second=lambda a, b: f"{b}.mul_({a})"),
    "div": _infix("/", 6, lambda sp, a, b: a / b, lambda a, b: a / b,
                  lambda n, d: sub(div(d[0], n.args[1]),
                                   div(mul(n.args[0], d[1]), Node("pow", (n.args[1], num(2))))), inplace="div_"),
    "neg": _infix("-", 7, lambda sp, a: -a, lambda a: -a, lambda n, d: neg(d[0]), arity=1, inplace="neg_"),
    "pow": _infix("^", 8, lambda sp, a, b: a ** b, _py_pow, _d_pow, torch_sym="**", inplace="pow_"),
    "abs": _fn("abs", lambda sp, a: sp.Abs(a), lambda a: f"torch.abs({a})", abs, lambda a: f"np.abs({a})",
               lambda n, d: mul(call("sign", n.args[0]), d[0]), inplace="abs_"),
    "sign": _fn("sign", lambda sp, a: sp.sign(a), lambda a: f"torch.sign({a})", _sign, lambda a: f"np.sign({a})", _zero, inplace="sign_"),
    # log(π) = log(μ·r) is split into log(μ) + log(r) (both positive), so log(π) − log(μ) is log(r):
    # the analysis settles GMPO's conditions on the raw log-ratio as fast as on log(r)
    "log": _fn("log", lambda sp, a: sp.expand_log(sp.log(a)), lambda a: f"torch.log({a})", math.log, lambda a: f"np.log({a})",
               lambda n, d: div(d[0], n.args[0]), inplace="log_"),
    "exp": _fn("exp", lambda sp, a: sp.exp(a), lambda a: f"torch.exp({a})", math.exp, lambda a: f"np.exp({a})",
               lambda n, d: mul(n, d[0]), inplace="exp_"),
    "sqrt": _fn("sqrt", lambda sp, a: sp.sqrt(a), lambda a: f"torch.sqrt({a})", math.sqrt, lambda a: f"np.sqrt({a})",
                lambda n, d: div(d[0], mul(num(2), n)), inplace="sqrt_"),
    "erf": _fn("erf", lambda sp, a: sp.erf(a), lambda a: f"torch.erf({a})", math.erf, _np_erf,
               lambda n, d: mul(call("derf", n.args[0]), d[0]), inplace="erf_"),
    # erf′(x) = 2/√π·e^(−x²), erf's derivative (not in the language: the language's π is a
    # probability, and IR numbers are exact fractions, so the constant 2/√π lives here, exact in SymPy)
    "derf": _fn("erf′", lambda sp, a: 2 / sp.sqrt(sp.pi) * sp.exp(-a**2),
                lambda a: f"({_TWO_OVER_SQRT_PI!r} * torch.exp(-torch.square({a})))",
                lambda a: _TWO_OVER_SQRT_PI * math.exp(-a * a), lambda a: f"({_TWO_OVER_SQRT_PI!r} * np.exp(-np.square({a})))",
                lambda n, d: mul(mul(num(-2), mul(n.args[0], n)), d[0])),
    "atan": _fn("atan", lambda sp, a: sp.atan(a), lambda a: f"torch.atan({a})", math.atan, lambda a: f"np.arctan({a})",
                lambda n, d: div(d[0], add(ONE, power(n.args[0], num(2)))), inplace="atan_"),
    # x/(1 + |x|): nan at ±inf in every lowering, as the formula is in IEEE arithmetic
    "softsign": _fn("softsign", lambda sp, a: a / (1 + sp.Abs(a)), lambda a: f"({a} / (1.0 + torch.abs({a})))",
                    lambda a: a / (1 + abs(a)),
                    lambda a: f"({a} / (1 + np.abs({a})))",
                    lambda n, d: div(d[0], power(add(ONE, call("abs", n.args[0])), num(2))), reuses_args=True),
    # SymPy rows give values only (derivatives come from the IR rules), unevaluated, so that
    # the analysis can settle each case's conditions itself before building any Piecewise.
    "min": _fn("min", lambda sp, *a: sp.Min(*a, evaluate=False),
               _t_where_extreme("<="), _pymin, _np_reduce("minimum"),
               lambda n, d: _d_extreme(n, d, {False: "le", True: "lt"}), arity=(2, None), reuses_args=True),
    "max": _fn("max", lambda sp, *a: sp.Max(*a, evaluate=False),
               _t_where_extreme(">="), _pymax, _np_reduce("maximum"),
               lambda n, d: _d_extreme(n, d, {False: "ge", True: "gt"}), arity=(2, None), reuses_args=True),
    "clip": _fn("clip", lambda sp, x, lo, hi: sp.Min(sp.Max(x, lo, evaluate=False), hi, evaluate=False),
                _t_clip,
                lambda x, lo, hi: min(max(x, lo), hi), lambda x, lo, hi: f"np.minimum(np.maximum({x}, {lo}), {hi})", _d_clip, arity=(3, 3), reuses_args=True),
    "sg": _fn("sg", lambda sp, a: a, lambda a: f"({a}).detach()", lambda a: a, lambda a: a, _zero),
    "ind": Op((1, 1), "num", "bool", lambda sp, c: sp.Piecewise((1, c), (0, True), evaluate=False),
              lambda c: f"({c}).to(dtype)", float, lambda c: f"np.asarray({c}, dtype=float)", _zero, 100, "[]",
              floats=lambda c: c),
    # [c]·x as codegen writes it (dsl.codegen._select_masks; not in the language): x where c holds,
    # else 0 even where x is inf or NaN, as PolicyLoss's torch.where(keep, ratio, 0) drops them
    "select": Op((2, 2), "num", "num", lambda sp, c, x: sp.Piecewise((x, c), (0, True), evaluate=False),
                 _t_select, lambda c, x: x if c else 0.0, lambda c, x: f"np.where({c}, {x}, 0.0)",
                 lambda n, d: ZERO if is_num(d[1], 0) else Node("select", (n.args[0], d[1])), 100, "select",
                 floats=lambda c, x: ((f"{x[0]}.mul_({c[0]})" if x[1] else f"({x[0]} * {c[0]})"), True)),
    "lt": _cmp("lt", "<", "<", lambda sp, a, b: sp.Lt(a, b, evaluate=False), lambda a, b: a < b),
    "le": _cmp("le", "≤", "<=", lambda sp, a, b: sp.Le(a, b, evaluate=False), lambda a, b: a <= b),
    "gt": _cmp("gt", ">", ">", lambda sp, a, b: sp.Gt(a, b, evaluate=False), lambda a, b: a > b),
    "ge": _cmp("ge", "≥", ">=", lambda sp, a, b: sp.Ge(a, b, evaluate=False), lambda a, b: a >= b),
    "eq": _cmp("eq", "==", "==", lambda sp, a, b: sp.Eq(a, b, evaluate=False), lambda a, b: a == b),
    "ne": _cmp("ne", "≠", "!=", lambda sp, a, b: sp.Ne(a, b, evaluate=False), lambda a, b: a != b),
    "and": _infix("and", 2, lambda sp, a, b: sp.And(a, b), lambda a, b: a and b,
                  NOT_DIFFERENTIABLE, "&", kind="bool", args_kind="bool", np=_np_reduce("logical_and"), floats=_f_and),
    "or": _infix("or", 1, lambda sp, a, b: sp.Or(a, b), lambda a, b: a or b,
                 NOT_DIFFERENTIABLE, "|", kind="bool", args_kind="bool", np=_np_reduce("logical_or"), floats=_f_or),
    "not": _infix("not ", 3, lambda sp, a: sp.Not(a), lambda a: not a,
                  NOT_DIFFERENTIABLE, "~", kind="bool", args_kind="bool", arity=1,
                  np=lambda a: f"np.logical_not({a})", floats=_f_not),
    **{f"seq_{k}": _seq(k) for k in ("sum", "mean", "max", "min")},
}

# Functions a user may call by name (the rest are operators or brackets).
FUNCTIONS = {k: OPS[k].arity for k in ("log", "exp", "sqrt", "abs", "sign", "erf", "atan", "softsign",
                                       "min", "max", "clip", "sg",
                                       "seq_sum", "seq_mean", "seq_max", "seq_min")}
# Reductions wider than one response: refused by name, with the reason (an update's tokens are
# split across micro-batches and ranks, so a batch statistic would silently change with them).
BATCH_WIDE = ("mean", "sum", "std", "var", "median", "quantile", "percentile", "topk", "top_k", "kthvalue",
              "rank", "softmax", "logsumexp", "whiten", "normalize", "batch_mean", "batch_sum", "batch_max",
              "batch_min", "batch_std", "group_mean", "group_std", "argmax", "argmin", "cumsum", "cummax")
SEQ_REDUCTIONS = tuple(k for k in OPS if OPS[k].reduce)


# ---------------------------------------------------------------- generic walks
R_SEEDS = {"r": ONE, "pi": Node("var", value="mu")}


def derivative(n: Node, seeds: dict | None = None) -> Node:
    """The derivative of n given the leaves' derivatives (`seeds`, name -> Node). The
    default is ∂/∂r with μ and A constant (μ is fixed during the update), so dπ/dr = μ;
    the torch compiler passes seeds for ∂/∂log π. Both use the same rules from OPS."""
    seeds = R_SEEDS if seeds is None else seeds
    memo: dict = {}
    for m in postorder(n):      # children first: each shared node is differentiated once
        if m.op == "num" or m.op == "param":
            memo[m] = ZERO
        elif m.op == "var":
            memo[m] = seeds.get(m.value, ZERO)
        elif passes_no_gradient(m.op):
            memo[m] = ZERO      # sg, sign, [..] never look inside; a bare condition is refused below
        elif OPS[m.op].deriv is REDUCTION:
            # seq_mean(A) is a constant; seq_mean(log r) moves with every token of its response
            memo[m] = ZERO if memo[m.args[0]] is not None and is_num(memo[m.args[0]], 0) else None
        elif any(memo[a] is None for a in m.args):
            memo[m] = None
        else:
            memo[m] = OPS[m.op].deriv(m, [memo[a] for a in m.args])
    if n.op in OPS and OPS[n.op].deriv is NOT_DIFFERENTIABLE:
        raise ValueError(f"a condition ({n.op}) has no derivative; it may only appear inside [...]")
    if memo[n] is None:
        raise NonLocal("a sequence reduction of the policy has no per-token derivative: a token's gradient "
                       "depends on its whole response (dsl.codegen differentiates it in reverse mode)")
    return memo[n]


class NonLocal(ValueError):
    """derivative() of an objective whose policy gradient passes through a sequence reduction."""


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
    if n.op == "ind":
        return "[" + sub(n.args[0]) + "]"
    if n.op == "select":
        return _render(Node("mul", (Node("ind", (n.args[0],)), n.args[1])), parent_prec, names, top)
    if n.op == "abs":
        return "|" + sub(n.args[0]) + "|"
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


def evaluate(n: Node, env: dict, frozen: dict | None = None) -> float:
    """Python-float value of n; env maps var/param names to floats. With `frozen`, each
    sg(...) keeps the first value it was evaluated at (for finite differences)."""
    memo: dict = {}
    for m in postorder(n):      # children first, each shared node once
        if m.op == "num":
            memo[m] = float(m.value)
        elif m.op in ("var", "param"):
            memo[m] = env[m.value]
        elif frozen is not None and m.op == "sg":
            memo[m] = frozen.setdefault(m, memo[m.args[0]])
        else:
            memo[m] = OPS[m.op].py(*(memo[a] for a in m.args))
    return memo[n]


@functools.lru_cache(maxsize=64)
def numpy_plan(*roots: Node):
    """roots' values over float64 arrays, as one function of env, its evaluation order fixed
    once: the numeric checks evaluate one expression thousands of times. With `frozen` (a
    dict, filled on the first call), each sg(...) keeps its first values, for finite
    differences. The plan is straight-line Python compiled once: a loop over a 1,500-node plan
    cost ~2 ms a call in interpretation alone, most of the arbiter's time on large objectives."""
    import numpy as np
    order, index = [], {}
    for root in roots:          # shared nodes of several roots are evaluated once
        for m in postorder(root):
            if m not in index:
                index[m] = len(order)
                order.append(m)
    names = {"np": np, "math": math, "_reduce": functools.reduce}
    lines = ["def run(env, frozen=None):", "    with np.errstate(all='ignore'):"]
    for i, m in enumerate(order):
        args = [f"v{index[a]}" for a in m.args]
        if m.op == "num":
            names[f"c{i}"] = _to_float(m.value)
            value = f"c{i}"
        elif m.op in ("var", "param"):
            value = f"env[{m.value!r}]"
        elif m.op == "sg":
            value = f"{args[0]} if frozen is None else frozen.setdefault({i}, {args[0]})"
        else:
            value = OPS[m.op].np(*args)
        lines.append(f"        v{i} = {value}")
    lines.append(f"    return [{', '.join(f'v{index[root]}' for root in roots)}]")
    exec(compile("\n".join(lines), "<numpy_plan>", "exec"), names)
    return names["run"]


def _to_float(v: Fraction) -> float:
    try:
        return float(v)
    except OverflowError:       # 10^400 as a double, as torch would hold it
        return math.copysign(math.inf, v)


def to_sympy(n: Node, sp, env: dict, hook=None, memo: dict | None = None):
    """Lower to SymPy. env maps names to SymPy objects; `hook(expr)` post-processes every
    lowered node (the analysis settles conditions there). Relations are built unevaluated:
    deciding them is the hook's job. Shared subtrees are lowered once, children first."""
    memo = {} if memo is None else memo
    for m in postorder(n):
        if m in memo:
            continue
        if m.op == "num":
            out = sp.Rational(m.value.numerator, m.value.denominator)
        elif m.op in ("var", "param"):
            out = env[m.value]
        else:
            out = OPS[m.op].sympy(sp, *(memo[a] for a in m.args))
        memo[m] = hook(out) if hook else out
    return memo[n]


def reads_whole_response(n: Node) -> bool:
    """A reduction over the response, or its length: a value that needs the whole response."""
    return (n.op in OPS and bool(OPS[n.op].reduce)) or (n.op == "var" and n.value == "seq_len")


def uniform_view(n: Node, anchor: str, rho: str) -> Node:
    """The objective on one response whose tokens all share r, μ and A, in r, μ, A and two
    parameters: each reduction is its value there (seq_mean(x) = x, seq_sum(x) = |y|·x, with
    |y| the parameter seq_len), and the policy μ is not is μ times the train/rollout ratio ρ
    (the parameter named `rho`): π_old = μ·ρ under @anchor = rollout, π_rollout = μ/ρ under
    @anchor = old. A token-level objective that names neither policy is returned as it is."""
    mu, length, ratio = Node("var", value="mu"), Node("param", value="seq_len"), Node("param", value=rho)
    other = {"old": ("pi_rollout", div(mu, ratio)), "rollout": ("pi_old", mul(mu, ratio))}[anchor]
    new: dict = {}
    for m in postorder(n):
        if m.op == "var" and m.value == f"pi_{anchor}":
            new[m] = mu
        elif m.op == "var" and m.value == other[0]:
            new[m] = other[1]
        elif m.op == "var" and m.value == "seq_len":
            new[m] = length
        elif m.op in OPS and OPS[m.op].reduce:
            new[m] = OPS[m.op].uniform(new[m.args[0]], length)
        else:
            new[m] = Node(m.op, tuple(new[a] for a in m.args), m.value, m.pos) if m.args else m
    return new[n]
