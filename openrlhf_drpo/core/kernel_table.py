"""Codegen's own table: how the emitter may treat each operation's torch text (its row's
`torch`) beyond writing it: in place on a fresh temporary, bound first, or, in the eager kernel,
a boolean as a 0/1 float. Every operation has an entry, checked when this module is imported."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dsl.lowerings import is_literal
from dsl.operations import OPS


@dataclass(frozen=True)
class Kernel:
    """How the emitter may treat an operation's torch text (its row's `torch`) beyond writing
    it: every operation has an entry in KERNELS, checked when this module is imported."""
    reuses_args: bool = False       # the torch text names an argument twice: bind it first
    inplace: str = ""               # torch method updating its first argument in place (add_, ...)
    # how a fresh second argument is updated in place, bit for bit ((a, b) -> source), if it can be
    inplace_second: Callable | None = None
    # the eager kernel's lowering of a boolean op, with booleans as 0/1 floats (comparisons
    # into a float tensor are ~4x faster on CPU than into bool): ((code, fresh), ...) -> (code, fresh)
    floats: Callable | None = None
    view: bool = False              # the result shares its argument's storage (sg's .detach(), a reduction's expand)


_MIRROR = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}


def _f_cmp(name):
    def lower(a, b):
        if is_literal(a[0]) or (b[1] and not a[1]):     # the tensor (a fresh one, if any) goes first
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


KERNELS = {
    "add": Kernel(inplace="add_", inplace_second=lambda a, b: f"{b}.add_({a})"),
    "sub": Kernel(inplace="sub_", inplace_second=lambda a, b: f"{b}.neg_().add_({a})"),    # IEEE: a - b is a + (-b)
    "mul": Kernel(inplace="mul_", inplace_second=lambda a, b: f"{b}.mul_({a})"),
    "div": Kernel(inplace="div_"), "neg": Kernel(inplace="neg_"), "pow": Kernel(inplace="pow_"),
    **{k: Kernel(inplace=f"{k}_") for k in ("log", "exp", "sqrt", "abs", "sign", "erf", "atan", "sigmoid", "tanh")},
    "derf": Kernel(), "softsign": Kernel(reuses_args=True), "softplus": Kernel(),
    **{k: Kernel(reuses_args=True) for k in ("min", "max", "clip")},
    "sg": Kernel(view=True),
    "ind": Kernel(floats=lambda c: c),
    "select": Kernel(floats=lambda c, x: (f"({x[0]} * {c[0]})" if is_literal(x[0]) or is_literal(c[0]) else
                                          f"torch.where({c[0]} != 0, {x[0]}, 0.0)", True)),   # selects: never 0·inf
    **{k: Kernel(floats=_f_cmp(k)) for k in ("lt", "le", "gt", "ge", "eq", "ne")},
    "and": Kernel(floats=_f_and), "or": Kernel(floats=_f_or), "not": Kernel(floats=_f_not),
    # a reduction's result may share storage (an expand): never updated in place (every row that reduces)
    **{k: Kernel(view=True) for k, op in OPS.items() if op.reduce},
}
if KERNELS.keys() != OPS.keys() or any(OPS[k].kind == "bool" and not KERNELS[k].floats for k in OPS):
    raise TypeError(f"openrlhf_drpo.core.kernel_table.KERNELS must have one entry per operation, a boolean one with `floats`: "
                    f"missing {sorted(OPS.keys() - KERNELS.keys())}, unknown {sorted(KERNELS.keys() - OPS.keys())}")
