"""Every row of the operation table (dsl.operations.OPS), one by one: its SymPy, Python,
numpy and torch lowerings give one value at every special double (±0, ±1e-300, ±1e300, ±inf,
NaN, ...), each documented difference asserted as what it is; its derivative rule equals
sympy.diff and torch's autograd at ordinary points, and at every special value the rule gives one
value in each lowering and autograd's wherever the arguments are finite (the fused kernel runs the
rule, the plain path autograd); and it declares every property the parser, the analysis and
codegen derive from it."""
import dataclasses
import functools
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import sympy as sp
import torch

import dsl
from openrlhf_drpo.core.kernel_table import KERNELS
from dsl.ir import ONE, ZERO, Node, num
from openrlhf_drpo.core.reductions import NAMESPACE
from dsl import operations, uniform
from dsl.operations import FUNCTIONS, OPS, Op
from dsl.walks import NonLocal, derivative, evaluate, held_count, numpy_plan, to_sympy

NAN, INF = math.nan, math.inf
SPECIAL = [0.0, -0.0, 1e-300, -1e-300, 1e-8, 0.3, -0.3, 1.0, -1.0, 2.5, -2.5, 6.0, -6.0, 27.0, -27.0, 40.0,
           1e8, -1e8, 1e300, -1e300, INF, -INF, NAN]
PAIRS = [0.0, -0.0, 0.3, 1.0, -1.0, 2.5, -2.5, 1e300, -1e300, INF, -INF, NAN]      # every pair of these
TRIPLES = [0.0, -0.0, 1.0, 2.0, -1.5, INF, -INF, NAN]                              # every triple
VALUED = [k for k, op in OPS.items() if not op.reduce]      # a reduction has no per-token value
REFUSED = "refused"         # SymPy will not order NaN
NOT_REAL = "not real"       # SymPy's zoo or a complex number


def kinds(name, n):
    """What each argument is: a number or a condition (select's first is its condition)."""
    if name == "select":
        return ("bool", "num")
    return (OPS[name].args_kind,) * n


def points(name):
    op = OPS[name]
    counts = [op.arity[0]] + ([3] if op.arity[1] is None else [])     # min and max of two and of three
    out = []
    for n in counts:
        values = [[True, False] if k == "bool" else SPECIAL if n == 1 else PAIRS if n == 2 else TRIPLES
                  for k in kinds(name, n)]
        out.append(list(itertools.product(*values)))
    return out


def by_python(op, args):
    try:
        return float(op.py(*args))
    except (ValueError, ZeroDivisionError, OverflowError) as e:
        return type(e)


def exact(p):
    if isinstance(p, bool):
        return sp.true if p else sp.false
    # a double exactly, to 30 digits: a Rational would make SymPy raise 1e300 to the 1e300 exactly
    return (sp.oo if p == INF else -sp.oo if p == -INF else sp.nan if p != p else sp.Integer(0) if p == 0
            else sp.Float(p, 30))


def by_sympy(op, args):
    try:
        v = op.sympy(sp, *map(exact, args)).doit()
    except TypeError:       # "Invalid NaN comparison"
        return REFUSED
    except ValueError as e:
        assert "not comparable" in str(e)
        return REFUSED
    if v in (sp.true, sp.false):
        return float(v == sp.true)
    if v is sp.nan:
        return NAN
    if v in (sp.oo, -sp.oo):
        return float(v)
    if v is sp.zoo or v.is_extended_real is False:
        return NOT_REAL
    return float(v.evalf(30))       # past a double's range: ±inf or 0, as IEEE rounds it


def columns(name, pts, tensor):
    names = [f"x{i}" for i in range(len(pts[0]))]
    cols = {}
    for i, (n, k) in enumerate(zip(names, kinds(name, len(names)))):
        values = np.array([p[i] for p in pts], dtype=bool if k == "bool" else float)
        cols[n] = torch.tensor(values) if tensor else values
    return names, cols


def by_numpy(name, pts):
    names, cols = columns(name, pts, False)
    with np.errstate(all="ignore"):
        out = eval(OPS[name].np(*names), {"np": np, "math": math, "_reduce": functools.reduce, **cols})
    return np.broadcast_to(np.asarray(out, dtype=float), (len(pts),))


def by_torch(name, pts, code=None):
    names, cols = columns(name, pts, True)
    out = eval(code or OPS[name].torch(*names), {"torch": torch, "dtype": torch.float64, **cols})
    return np.broadcast_to(torch.as_tensor(out).to(torch.float64).numpy(), (len(pts),))


def same(a, b) -> bool:
    return isinstance(a, float) and isinstance(b, float) and (
        (math.isnan(a) and math.isnan(b)) or a == b or math.isclose(a, b, rel_tol=1e-13, abs_tol=1e-300))


def has_nan(args) -> bool:
    return any(isinstance(a, float) and math.isnan(a) for a in args)


def ieee_power(args) -> bool:
    """pow's IEEE conventions that SymPy does not share (documented on the row)."""
    a, b = args
    return (abs(a) == 1 and not math.isfinite(b)) or (a < -1 and b == -INF)


def check(name, args, py, sy, n, t):
    """One point: numpy and torch are IEEE alike; Python equals them or raises where they are
    not finite; SymPy equals them where they are finite and is not a finite real elsewhere."""
    where = (name, args, {"py": py, "sympy": sy, "numpy": n, "torch": t})
    if name in ("min", "max", "clip") and has_nan(args):
        # documented: numpy gives NaN; torch.where and Python's min/max keep an argument; SymPy refuses
        assert math.isnan(n), where
        assert all(math.isnan(v) or any(v == a for a in args) for v in (t, py)), where
        assert sy is REFUSED or math.isnan(sy), where
        return
    if name == "sign" and has_nan(args):
        assert py == t == 0.0 and math.isnan(n) and math.isnan(sy), where     # documented
        return
    assert same(n, t), where
    if isinstance(py, type):
        assert not math.isfinite(n), where          # Python floats raise where IEEE gives inf or NaN
    else:
        assert same(py, n), where
    if name in ("lt", "le", "gt", "ge") and has_nan(args):
        assert sy is REFUSED, where                 # SymPy will not order NaN (== and != it answers)
    elif name == "pow" and math.isfinite(n) and ieee_power(args):
        assert math.isnan(sy), where                # documented: IEEE's conventions are NaN in SymPy
    elif math.isfinite(n):
        assert same(sy, n), where
    else:
        assert not (isinstance(sy, float) and math.isfinite(sy)), where


@pytest.mark.parametrize("name", VALUED)
def test_a_rows_sympy_python_numpy_and_torch_lowerings_agree_at_every_special_value(name):
    op = OPS[name]
    for pts in points(name):
        for args, n, t in zip(pts, by_numpy(name, pts), by_torch(name, pts)):
            check(name, args, by_python(op, args), by_sympy(op, args), float(n), float(t))


# torch text with constant arguments (folded parameters): torch.clamp for one constant bound, the
# constant itself for two, 0/1 times x for a constant condition
CONSTANTS = [-1.5, 0.0, 1.0, 2.0]


@pytest.mark.parametrize("name", ["min", "max", "clip", "select"])
def test_a_rows_torch_text_with_constant_arguments_agrees_with_numpy(name):
    n = OPS[name].arity[0]
    for constant in itertools.product([False, True], repeat=n):
        if all(constant):
            continue
        values = [[True, False] if k == "bool" and c else [True, False] if k == "bool" else CONSTANTS if c
                  else SPECIAL for k, c in zip(kinds(name, n), constant)]
        pts = list(itertools.product(*values))
        for args in pts:
            code = OPS[name].torch(*[repr(a) if c else f"x{i}" for i, (a, c) in enumerate(zip(args, constant))])
            t = float(by_torch(name, [args], code)[0])
            n_ = float(by_numpy(name, [args])[0])
            if name == "select" and constant[0] and not args[0] and not math.isfinite(args[1]):
                assert math.isnan(t) and n_ == 0.0, (code, args)    # documented: 0.0·inf is NaN
            elif name != "select" and has_nan(args) and "torch.where" in code:
                assert math.isnan(n_) and (math.isnan(t) or t in args), (code, args)      # documented
            else:
                assert same(t, n_), (code, args, t, n_)


# ---------------------------------------------------------------- derivatives
ORDINARY = {        # points away from kinks and ties, inside each row's domain
    1: [(0.3,), (-0.4,), (1.7,), (-1.3,), (2.5,), (6.0,)],
    2: [(0.7, 1.3), (-1.9, 0.6), (2.5, -0.4), (1.2, 0.5)],
    3: [(0.5, 0.8, 1.2), (1.0, 0.8, 1.2), (1.5, 0.8, 1.2), (1.0, 1.2, 0.8), (-0.3, 0.4, 1.7)],
}
POSITIVE = {"log", "sqrt", "pow"}       # their (first) argument must be positive


def ordinary(name):
    op = OPS[name]
    if name == "select":
        return [(True, 0.7), (False, -1.3), (True, 2.5)]
    pts = ORDINARY[op.arity[0]] + (ORDINARY[3][-1:] if op.arity[1] is None else [])
    return [(abs(p[0]),) + p[1:] for p in pts] if name in POSITIVE else pts


def node_and_env(name, args):
    """Node(name, variables) and the environment holding args; a condition argument is
    the condition c > 0 at c = ±1."""
    vars_, env = [], {}
    for i, (a, k) in enumerate(zip(args, kinds(name, len(args)))):
        v = Node("var", value=f"x{i}")
        env[f"x{i}"] = (1.0 if a else -1.0) if k == "bool" else a
        vars_.append(Node("gt", (v, num(0))) if k == "bool" else v)
    return Node(name, tuple(vars_)), env


RULES = [k for k, op in OPS.items() if callable(op.gradient)]


@pytest.mark.parametrize("name", RULES)
def test_a_rows_derivative_rule_equals_sympys_diff_and_autograd(name):
    op = OPS[name]
    for args in ordinary(name):
        n, env = node_and_env(name, args)
        numeric = [i for i, k in enumerate(kinds(name, len(args))) if k == "num"]
        xs = [sp.Symbol(f"x{i}", **({"positive": True} if name in POSITIVE and i == 0 else {"real": True}))
              for i in range(len(args))]
        value = op.sympy(sp, *[sp.Gt(x, 0) if k == "bool" else x for x, k in zip(xs, kinds(name, len(args)))])
        at = {x: exact(v) for x, v in zip(xs, env.values())}
        tensors = [torch.tensor(env[f"x{i}"] > 0 if i not in numeric else env[f"x{i}"], dtype=None if i not in
                                numeric else torch.float64, requires_grad=i in numeric) for i in range(len(args))]
        out = eval(op.torch(*[f"x{i}" for i in range(len(args))]), {"torch": torch, "dtype": torch.float64,
                                                                     **{f"x{i}": t for i, t in enumerate(tensors)}})
        grads = torch.autograd.grad(out, [tensors[i] for i in numeric])
        for i, grad in zip(numeric, grads):
            rule = derivative(n, {f"x{i}": ONE})
            got = evaluate(rule, env)
            diff = sp.diff(value, xs[i])
            assert math.isclose(got, float(diff.subs(at).doit().evalf(30)), rel_tol=1e-12, abs_tol=1e-300), \
                (name, args, i, got, diff)
            # documented on the row: torch's autograd of tanh is 1 − tanh², 1.2e-12 off at x = 6
            assert math.isclose(got, float(grad), rel_tol=1e-11 if name == "tanh" else 1e-12, abs_tol=1e-300), \
                (name, args, i, got, grad)
            if not op.piecewise:        # and symbolically, where SymPy can say so
                assert sp.simplify(to_sympy(rule, sp, {f"x{j}": x for j, x in enumerate(xs)}) - diff) == 0, (name, i)


def torch_text(n: Node) -> str:
    """A rule's torch text, row by row: each row's own text, as codegen writes it on its
    selecting path (without its in-place kernels)."""
    if n.op == "num":
        return repr(float(n.value))
    return n.value if n.op == "var" else OPS[n.op].torch(*map(torch_text, n.args))


# Where a rule and autograd part at finite arguments, each asserted as what it is: softsign's
# autograd cancels at |x| = 1e8 (4e-9 off; the rule is exact to 1e-16). (pow's rule takes torch's
# values at base ±0 and exponent 0, by its guards: it agrees with autograd at every finite point.)
CANCELS = {"sigmoid": 5.0, "tanh": 2.5}     # |x| past which autograd's derivative cancels (see below)
NAN_PICKS = {"abs", "min", "max", "clip"}    # at NaN a lowering gives NaN or picks an argument


@pytest.mark.parametrize("name", RULES)
def test_a_rows_derivative_rule_gives_one_value_in_every_lowering_and_autograds_at_every_special_value(name):
    for pts in points(name):
        n, _ = node_and_env(name, pts[0])
        ks = kinds(name, len(pts[0]))
        cols = {f"x{i}": np.array([(1.0 if p[i] else -1.0) if k == "bool" else p[i] for p in pts])
                for i, k in enumerate(ks)}
        tensors = {x: torch.tensor(v, requires_grad=k == "num") for (x, v), k in zip(cols.items(), ks)}
        value = eval(OPS[name].torch(*[f"({x} > 0)" if k == "bool" else x for x, k in zip(cols, ks)]),
                     {"torch": torch, "dtype": torch.float64, **tensors})
        for i in [i for i, k in enumerate(ks) if k == "num"]:
            rule = derivative(n, {f"x{i}": ONE})
            by_np = np.broadcast_to(numpy_plan(rule)(cols)[0], (len(pts),))
            by_t = np.broadcast_to(torch.as_tensor(eval(torch_text(rule), {"torch": torch, "dtype": torch.float64,
                                   **{x: t.detach() for x, t in tensors.items()}}), dtype=torch.float64), (len(pts),))
            auto = torch.autograd.grad(value.sum(), tensors[f"x{i}"], retain_graph=True)[0].numpy()
            for j, args in enumerate(pts):
                py = _rule_by_python(rule, {x: float(v[j]) for x, v in cols.items()})
                nv, tv, av = float(by_np[j]), float(by_t[j]), float(auto[j])
                where = (name, i, args, {"py": py, "numpy": nv, "torch": tv, "autograd": av})
                if has_nan(args) and name in NAN_PICKS:
                    # documented: numpy's NaN against torch.where's and Python's pick of an argument
                    assert all(isinstance(v, float) and (math.isnan(v) or v in (0.0, 1.0, -1.0)) for v in (py, nv, tv)), where
                    continue
                assert same(nv, tv), where
                if isinstance(py, type):
                    # Python floats raise where IEEE is not finite, or on an overflowing x² whose
                    # IEEE quotient rounds to 0 (1/(1 + x²) at |x| = 1e300)
                    assert not math.isfinite(nv) or (nv == 0 and py is OverflowError and abs(args[-1]) == 1e300), where
                else:
                    assert same(py, nv), where
                if not all(isinstance(a, bool) or math.isfinite(a) for a in args):
                    continue        # autograd's own conventions at ±inf and NaN: the lowerings above decide
                tol = 1e-8 if name == "softsign" else 1e-13
                if name in CANCELS and abs(args[0]) > CANCELS[name]:
                    # autograd's σ(1 − σ) and 1 − tanh² cancel past there (4e-5 off at x = 27, 0 once σ
                    # rounds to 1); the rule is exact: held to sympy.diff above, in every lowering here
                    assert av == 0 or math.isclose(nv, av, rel_tol=1e-2), where
                    continue
                assert (math.isnan(nv) and math.isnan(av)) or math.isclose(nv, av, rel_tol=tol, abs_tol=1e-300), where


def _rule_by_python(rule, env):
    try:
        return float(evaluate(rule, env))
    except (ValueError, ZeroDivisionError, OverflowError) as e:
        return type(e)


@pytest.mark.parametrize("name", [k for k, op in OPS.items() if op.gradient == "zero"])
def test_a_row_whose_gradient_is_zero_differentiates_to_zero_in_every_lowering(name):
    x = Node("var", value="x0")
    n = Node(name, (Node("gt", (x, num(1))),) if OPS[name].args_kind == "bool" else (x,))
    assert derivative(n, {"x0": ONE}) is ZERO
    s = sp.Symbol("x0", real=True)
    value = OPS[name].sympy(sp, sp.Gt(s, 1) if OPS[name].args_kind == "bool" else s)
    t = torch.tensor([0.4, 1.7, -2.5], dtype=torch.float64, requires_grad=True)
    out = eval(OPS[name].torch("(t > 1)" if OPS[name].args_kind == "bool" else "t"),
               {"torch": torch, "dtype": torch.float64, "t": t})
    if name == "sg":
        # sg's SymPy lowering is its value, the identity: the analysis differentiates the IR (its
        # row's "zero"), never SymPy; torch's .detach() leaves nothing to differentiate
        assert sp.diff(value, s) == 1 and not out.requires_grad
        return
    for p in (0.4, 1.7, -2.5):
        assert sp.diff(value, s).subs(s, exact(p)) == 0
    # [c]: a comparison leaves torch's graph; sign: autograd's gradient is 0
    assert not out.requires_grad or not torch.autograd.grad(out.sum(), t)[0].any()


@pytest.mark.parametrize("name", [k for k, op in OPS.items() if op.gradient == "none"])
def test_a_condition_has_no_derivative_and_is_refused_where_one_is_asked_for(name):
    x = Node("var", value="r")
    args = (Node("gt", (x, num(1))),) * OPS[name].arity[0] if OPS[name].args_kind == "bool" else (x, num(1))
    with pytest.raises(ValueError, match=rf"a condition \({name}\) has no derivative; it may only appear inside"):
        derivative(Node(name, args))
    assert derivative(Node("ind", (Node(name, args),))) is ZERO


# ---------------------------------------------------------------- reductions
def _reductions():
    """The reductions' torch functions, by the names the generated code gives them (core.reductions)."""
    return {"torch": torch, "math": math, **NAMESPACE}


def _reduced(name, level, values, mask):
    """The row's torch text on one response (a group of one, a batch of one)."""
    op = OPS[name]
    code = op.torch("v", *constant_args(op), level) if op.over in ("group", "batch") else op.torch("v", *constant_args(op))
    return eval(code, {**_reductions(), "v": values, "m": mask, "logp": values, "group": torch.zeros(1, dtype=torch.long),
                       "pg": None, "turns": torch.zeros_like(mask, dtype=torch.long)})[0]     # one turn


def constant_args(op):
    """A value for each constant argument a row takes (batch_quantile's q), inside its declared range."""
    return [repr(lo + 0.3 * (hi - lo)) for _, lo, hi in op.constants]


# a group or batch reduction reads its argument's level: each is checked at both
# (a vocabulary sum reads a token's entries, not tokens: tests/test_vocabulary.py holds its rows)
LEVELED = [(k, level) for k, op in OPS.items() if op.reduce and op.over != "vocab"
           for level in (("token", "response") if op.over in ("group", "batch") else ("token",))]


@pytest.mark.parametrize("name, level", LEVELED)
def test_a_reduction_where_all_it_reduces_is_equal_is_its_rows_uniform_value(name, level):
    """At every position p of a response of |y| = 3 equal tokens (a group of G = 1, a batch of N = 1),
    the torch text gives the row's uniform value with uniform_view's count (held_count)."""
    op = OPS[name]
    length = 3
    for x in SPECIAL:
        values = torch.full((1, length), x, dtype=torch.float64)
        mask = torch.ones(1, length, dtype=torch.bool)
        got = _reduced(name, level, values, mask)
        for p in range(1, length + 1):
            point = {k: Node("num", value=Fraction(v)) for k, v in
                     (("seq_len", length), ("position", p), ("group_size", 1), ("batch_size", 1))}
            constants = [num(Fraction(c)) for c in constant_args(op)]
            want = evaluate(op.uniform(Node("var", value="x"), held_count(name, level, point), *constants), {"x": x})
            assert same(float(got[p - 1]), want), (name, x, p, got, want)
        empty = _reduced(name, level, values, torch.zeros_like(mask))
        assert not empty.any()      # an empty response reduces to 0
    for lowering in (lambda: op.sympy(sp, sp.Symbol("x")), lambda: op.py(1.0), lambda: op.np("x")):
        with pytest.raises(ValueError, match=f"{name} has no per-token value: rewrite reductions first"):
            lowering()
    constants = tuple(num(Fraction(c)) for c in constant_args(op))
    assert derivative(Node(name, (Node("var", value="A"), *constants))) is ZERO         # a constant response
    if op.adjoint == "none":        # a count (or the quantile's weight) reads no value: never a gradient
        assert derivative(Node(name, (Node("var", value="r"), *constants))) is ZERO
        return
    with pytest.raises(NonLocal, match="a reduction of the policy has no per-token derivative"):
        derivative(Node(name, (Node("var", value="r"), *constants)))


# ---------------------------------------------------------------- declarations
def test_every_row_declares_every_property_and_a_missing_one_fails_at_once():
    required = [f.name for f in dataclasses.fields(Op) if f.default is dataclasses.MISSING]
    assert {"continuous", "branching", "gradient", "piecewise", "exact", "not_real", "callable",
            "compares"} <= set(required)
    row = {f: getattr(OPS["exp"], f) for f in required}
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'continuous'"):
        Op(**{k: v for k, v in row.items() if k != "continuous"})
    with pytest.raises(TypeError, match="operation 'exp': gradient must be a rule or one of"):
        Op(**{**row, "gradient": "pass"})
    for name, op in OPS.items():
        assert callable(op.sympy) and callable(op.torch) and callable(op.py) and callable(op.np), name
        assert op.symbol and op.prec > 0 and op.kind in ("num", "bool"), name
        assert isinstance(op.continuous, bool) or callable(op.continuous), name
        assert isinstance(op.branching, bool) and isinstance(op.piecewise, bool), name
        assert not op.piecewise or op.branching, name       # a Piecewise is a branch SymPy settles


def test_codegen_has_a_kernel_entry_for_every_row_and_the_eager_floats_of_every_condition():
    assert KERNELS.keys() == OPS.keys()
    assert all(callable(KERNELS[k].floats) for k, op in OPS.items() if op.kind == "bool")


def test_the_functions_a_user_calls_are_the_callable_rows_each_with_its_signature():
    # derived from the table (an atom added to it joins without a list to edit here): each callable
    # row parses by name, its arity and signature in the hint; every other row is no function
    assert FUNCTIONS == {k: op.arity for k, op in OPS.items() if op.callable}
    for name, op in OPS.items():
        if not op.callable:
            assert name not in FUNCTIONS
            if name.isidentifier() and name not in ("and", "or", "not"):     # keywords are operators
                with pytest.raises(dsl.DslError, match=rf"unknown function '{name}'"):
                    dsl.parse(f"r*A*{name}(r)")
            continue
        sig = op.signature
        assert sig.startswith(f"{name}(") and FUNCTIONS[name] == op.arity
        with pytest.raises(dsl.DslError, match=rf"hint: write {sig.replace('(', '[(]').replace(')', '[)]')}"):
            dsl.parse(f"r*A*{name}()")


# ---------------------------------------------------------------- every property declared on its row
REDUCTION_ROWS = [k for k, op in OPS.items() if op.reduce]
WIDE = next(k for k in REDUCTION_ROWS if OPS[k].over == "group" and callable(OPS[k].spread))


@pytest.mark.parametrize("row, prop", [(k, p) for k in ("seq_sum", WIDE) for p in ("reduce", "over", "uniform", "held")]
                         + [(WIDE, "spread")])
def test_a_reduction_row_lacking_a_property_is_refused_when_it_is_built_naming_the_row_and_the_property(row, prop):
    """A contributor's row (a copy of a real one, the real table untouched) that leaves one property out:
    refused when the row is built (at import), never analysed from a default of its kind."""
    fields = {f.name: getattr(OPS[row], f.name) for f in dataclasses.fields(Op)}
    blank = {"reduce": "", "over": ""}.get(prop, operations.UNDECLARED)
    with pytest.raises(TypeError, match=rf"operation '{OPS[row].symbol}': .*a reduction declares {prop}= on its row"):
        Op(**{**fields, prop: blank})
    Op(**fields)       # the row as it is: accepted


def test_a_property_only_a_reduction_or_a_group_reduction_has_is_refused_elsewhere():
    exp = {f.name: getattr(OPS["exp"], f.name) for f in dataclasses.fields(Op)}
    with pytest.raises(TypeError, match="operation 'exp': only a reduction declares held, uniform"):
        Op(**{**exp, "uniform": OPS["seq_sum"].uniform, "held": OPS["seq_sum"].held})
    seq = {f.name: getattr(OPS["seq_sum"], f.name) for f in dataclasses.fields(Op)}
    with pytest.raises(TypeError, match="operation 'seq_sum': only a group or batch reduction declares spread"):
        Op(**{**seq, "spread": OPS["group_sum"].spread})


@pytest.mark.parametrize("table, key, prop", [(uniform.UNIFORM, "prod", "uniform"), (uniform.BRANCHING, "prod", "branching"),
                                              (uniform.SPREAD, "prod", "spread"), (uniform.HELD, "diagonal", "held")])
def test_the_uniform_held_count_and_spread_lookups_refuse_an_unknown_kind_by_name(table, key, prop):
    """seq_prod was analysed as its argument (the uniform value's default), an unknown `over` counted as
    the batch, an unknown kind spread as the sample std: each lookup now refuses the kind, naming the row."""
    with pytest.raises(TypeError, match=rf"operation 'seq_prod': no {prop} is declared for '{key}'.*declare {prop}="):
        uniform.declared(table, key, "seq_prod", prop)


def test_a_new_reduction_kind_without_declarations_is_refused_at_import():
    """The row as a contributor adds it, through the table's own factory: refused while the module builds it."""
    with pytest.raises(TypeError, match="operation 'seq_prod': no uniform is declared for 'prod'"):
        operations._reduction("seq_prod", "response", "prod", adjoint=OPS["seq_sum"].adjoint)
    with pytest.raises(TypeError, match="operation 'diag_sum': no held is declared for 'diagonal'"):
        operations._reduction("diag_sum", "diagonal", "sum", adjoint=OPS["seq_sum"].adjoint)
