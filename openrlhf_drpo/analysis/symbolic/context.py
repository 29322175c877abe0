"""One analysis run's context: its SymPy symbols, ∂ℓ/∂r, the notes it collects, and the
guarded way every risky SymPy step is taken (its work budget first, its fallback past it, and
what is left of the hang guard), with the formula tidying that every case shares."""
from __future__ import annotations

import time

from openrlhf_drpo.analysis import budgets
from openrlhf_drpo.analysis.budgets import BUDGET, OverBudget, Timeout, Unsettled, size, time_limit
from dsl.objective import Objective
from dsl.walks import derivative


def degree(sp, e) -> int:
    """An upper bound on e's degree as a polynomial in its symbols, from its tree alone
    (cancel and factor_terms cost grows with it: degree 9 takes SymPy seconds)."""
    if e.is_Symbol:
        return 1
    if e.is_Pow and e.exp.is_Integer:
        return abs(int(e.exp)) * degree(sp, e.base)
    if e.is_Mul:
        return sum(degree(sp, a) for a in e.args)
    return max((degree(sp, a) for a in e.args), default=0)


def tidy(sp, e):
    """Cheap canonical form: 1 - 2·μ·(r - 1)/25 rather than an expanded sum."""
    if isinstance(e, sp.Piecewise):
        return sp.Piecewise(*[(tidy(sp, x), c) for x, c in e.args])
    if any(p.exp.is_Integer and abs(p.exp) > 8 for p in e.atoms(sp.Pow)):
        return e        # expanding (1 - t)^127 gives huge alternating terms that cancel badly in floats
    e = sp.cancel(e) if e.is_rational_function() else e
    # exp(A·(r − 1)) stays whole: exp(−A)·exp(A·r) is 0·inf in floats for |A| = 1000; and a
    # product of exponentials whose exponents cancel a variable is one (tanh's e^(2 − 2r)·e^(2r − 2),
    # from expanding its rule, is 1, and inf·0 in floats far out)
    const, rest = sp.expand(e, power_exp=False, power_base=False, log=False).as_coeff_Add()
    rest = rest.replace(lambda x: x.is_Mul and _cancelling_exps(sp, x), lambda x: sp.powsimp(x, combine="exp"))
    return const + sp.factor_terms(rest)


def _cancelling_exps(sp, product) -> bool:
    exps = [f.args[0] for f in product.args if isinstance(f, sp.exp)]
    return len(exps) > 1 and len(sp.Add(*exps).free_symbols) < len(set().union(*(x.free_symbols for x in exps)))


class Ctx:
    """SymPy symbols and the notes a run collects (fallbacks taken, etc.)."""

    def __init__(self, obj: Objective):
        import sympy as sp
        self.sp = sp
        self.obj = obj
        self.r, self.mu, self.pi = sp.symbols("r mu pi", positive=True)
        self.A = sp.Symbol("A", real=True, nonzero=True)
        self.a, self.t = sp.symbols("a t", positive=True)
        self.param_syms = {k: sp.Symbol(k, positive=True) if v > 0 else sp.Symbol(k, real=True)
                           for k, v in obj.params.items()}
        self.param_vals = {k: sp.Rational(v.numerator, v.denominator) for k, v in obj.params.items()}
        self.dl = derivative(obj.expr)
        self.notes: list[str] = []
        self._tidied: dict = {}
        self.settled: dict = {}     # each case's settled conditions, by its r = 1 ± t (symbolic.settling)
        self.deadline = time.process_time() + budgets.HANG_SECONDS
        self.guard = {"seconds": budgets.HANG_SECONDS, "fired": False}

    def hang(self, what):
        """The hang guard fired (never in a normal run): said in a note and in the JSON."""
        self.guard["fired"] = True
        self.note(f"{what}: the hang guard fired (SymPy ran past {budgets.HANG_SECONDS:g} s of CPU time, a limit far "
                  "above any normal run); the numeric check's findings stand")

    def guarded(self, what, fn, default=None):
        """limited(), under what is left of the hang guard."""
        try:
            with time_limit(max(self.deadline - time.process_time(), 1e-3)):
                return self.limited(what, fn, default)
        except Timeout:
            self.hang(what)
            return default

    def tidy(self, e):
        if e in self._tidied:      # the four cases and their candidates tidy the same pieces again
            return self._tidied[e]
        if size(e) > BUDGET["tidy"] or degree(self.sp, e) > BUDGET["degree"]:     # shown as built: exact, only longer
            out = e
        else:
            out = self.limited("simplifying", lambda: tidy(self.sp, e), e)
        self._tidied[e] = out
        return out

    def env(self, symbolic: bool):
        params = self.param_syms if symbolic else self.param_vals
        return {"r": self.r, "mu": self.mu, "pi": self.mu * self.r, "A": self.A, **params}

    def note(self, text):
        if text not in self.notes:
            self.notes.append(text)

    def limited(self, what, fn, default=None):
        """fn() or, past a budget (OverBudget, raised before the step) or where SymPy fails,
        the default, with a note. Both are decided by the input alone, never by the clock."""
        try:
            return fn()
        except Unsettled:
            raise
        except OverBudget as e:
            self.note(f"{what}: {e}; used the fallback")
        except Timeout:
            raise
        except Exception as e:  # SymPy raises many types (NotImplementedError, RecursionError, ...)
            self.note(f"{what}: SymPy failed ({type(e).__name__}); used the fallback")
        return default
