"""The lowering hook that settles one case's conditions as they are built: every Min, Max and
Piecewise the IR lowers to becomes pieces whose conditions are relations t ⋚ c, settled against
the case's domain (analysis.symbolic.intervals) as soon as they exist, so that SymPy never nests conditions it
would have to untangle later. Each condition and relation settled counts against the settling
budget (analysis.budgets)."""
from __future__ import annotations

from openrlhf_drpo.analysis.budgets import check_budget
from openrlhf_drpo.analysis.symbolic.cells import in_outer, settle_moving
from openrlhf_drpo.analysis.symbolic.intervals import Domain, in_mu, linear_in_t, settle_condition


def _split_abs(sp, h, t):
    """h with each |x| whose sign SymPy cannot tell (|log(1 − t)|) as x where x ≥ 0, −x elsewhere,
    so that each side is settled on its own: a band |log r| ≤ c keeps both its edges."""
    return h.replace(lambda x: isinstance(x, sp.Abs) and t in x.free_symbols,
                     lambda x: sp.Piecewise((x.args[0], sp.Ge(x.args[0], 0, evaluate=False)), (-x.args[0], True)))


class Settle:
    """The hook for one case (sign of A × direction): to_sympy calls it on every lowered node."""

    def __init__(self, ctx, tmax, memo=None):
        self.ctx, self.sp = ctx, ctx.sp
        self.dom = Domain(ctx.sp, ctx.t, ctx.mu, ctx.a, tmax)
        self.steps = 0      # conditions and relations settled: the work counted against BUDGET["settle"]
        self.memo: dict = {} if memo is None else memo      # shared: see derivation.case_weight

    def _count(self):
        self.steps += 1
        check_budget("settle", self.steps)

    def _memo(self, fn, x):
        """fn(x) once per memo (a case, with its twin of the same r: derivation.case_weight):
        folding rebuilds the same conditions many times over. A repeat
        is one step, the work it costs: counting the steps its first settling took made the
        budget count a condition shared by the pieces of one clip as often as they share it."""
        key = (fn.__name__, x)
        if key in self.memo:
            self._count()
            return self.memo[key]
        out = fn(x)
        self.memo[key] = out
        return out

    def __call__(self, e):
        sp = self.sp
        if isinstance(e, (sp.Min, sp.Max)):   # first argument attaining the extreme, as in the IR rule
            le, lt = (sp.Le, sp.Lt) if isinstance(e, sp.Min) else (sp.Ge, sp.Gt)
            args = [self(x) if isinstance(x, (sp.Min, sp.Max)) else x for x in e.args]
            e = sp.Piecewise(*[(x, self.cond(sp.And(*[(lt if j < i else le)(x, y, evaluate=False)
                                                      for j, y in enumerate(args) if j != i])))
                               for i, x in enumerate(args)][:-1], (args[-1], True))
        if isinstance(e, sp.Piecewise):
            pieces = []
            for x, c in e.args:
                c = self.cond(c)
                if c == sp.false:
                    continue
                pieces.append((x, c))
                if c == sp.true:
                    break
            if not pieces:
                return sp.nan
            if pieces[0][1] == sp.true:
                return pieces[0][0]
            return sp.Piecewise(*pieces[:-1], (pieces[-1][0], True))
        if isinstance(e, sp.logic.boolalg.Boolean) and not isinstance(e, sp.Symbol):
            return self.cond(e)
        return e

    def cond(self, c):
        return self._memo(self._cond, c)

    def _cond(self, c):
        sp = self.sp
        self._count()
        if c in (True, False, sp.true, sp.false):
            return sp.true if c in (True, sp.true) else sp.false
        if isinstance(c, sp.ITE):   # SymPy writes a Piecewise inside a condition as ITE
            i, x, y = c.args
            return self.cond(sp.Or(sp.And(i, x), sp.And(sp.Not(i), y)))
        if isinstance(c, (sp.And, sp.Or, sp.Not)):
            out = c.func(*[self.cond(x) for x in c.args])
        elif isinstance(c, sp.core.relational.Relational):
            out = self.relation(c)
        else:
            return c
        settled = settle_condition(self.dom, out)
        if settled is out and self.dom.t in out.free_symbols:
            # thresholds that move with μ or |A| and change order as they move: settled in cells
            moved = settle_moving(self.dom, out)
            settled = out if moved is None else moved
        return settled

    def fold(self, e, cond=None):
        """[(expr, condition)] without Piecewise, conditions settled and mutually exclusive.
        SymPy's piecewise_fold does this too, but calls simplify_logic, which is slow."""
        sp = self.sp
        cond = sp.true if cond is None else cond
        found = e.atoms(sp.Piecewise)
        if not found:
            return [(e, cond)]
        P = min(found, key=sp.default_sort_key)     # a set: pick the same one in every process
        out, before = [], []
        for x, c in P.args:   # first match wins: branch i also excludes branches 1..i-1
            cc = self.cond(sp.And(cond, *before, c))
            before.append(sp.Not(c))
            if cc != sp.false:
                out += self.fold(e.xreplace({P: x}), cc)
        return out

    def relation(self, e):
        if not isinstance(e, self.sp.core.relational.Relational):
            return e
        return self._memo(self._relation, e)

    def _relation(self, e):
        sp, t = self.sp, self.dom.t
        self._count()
        h = e.lhs - e.rhs
        h = _split_abs(sp, h, t)
        if h.has(sp.Piecewise):   # distribute: h_i ⋚ 0 where piece i holds
            return self.cond(sp.Or(*[sp.And(c, self.relation(e.func(x, 0))) for x, c in self.fold(h)]))
        h = sp.expand(h)
        if t not in h.free_symbols:
            out = in_mu(self.dom, e.func, h)
            # not linear in μ or 1/μ: decided where it keeps one sign over the domain, or else
            # intervals between its roots, where they are found exactly
            if not isinstance(out, sp.core.relational.Relational) or out.lhs in (self.dom.mu, self.dom.a):
                return out
            solved = in_outer(self.dom, out)
            return out if solved is None else solved
        # log(x) ⋚ c ⟺ x ⋚ e^c: log is increasing, and where x ≤ 0 the objective is undefined
        # anyway (GMPO's clip in log space, OPSM's mean log-ratio)
        logs = [a for a in sp.Add.make_args(h) if isinstance(a, sp.log) and t in a.free_symbols]
        if len(logs) == 1 and t not in (h - logs[0]).free_symbols:
            return self.relation(e.func(logs[0].args[0] - sp.exp(-(h - logs[0])), 0, evaluate=False))
        return linear_in_t(self.dom, e.func, h)
