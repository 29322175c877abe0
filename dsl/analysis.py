"""What an objective does to each token's gradient: the symbolic derivation (dsl.symbolic)
and the numeric arbiter (dsl.arbiter, dsl.events, dsl.extremes), joined where each claim
is confirmed (dsl.confirm).

Work is bounded by budgets counted in work, never in seconds, so that the same objective
gives the same report on any machine under any load: before each risky SymPy step (tidying,
simplify, a limit, roots, settling a case's conditions) the size of its input is counted, and
past its budget that step takes its fallback, and a note says so. A time limit, HANG_SECONDS
of this process's CPU time, stays only as a guard against a hang, far above any normal run
(and, being CPU time, unmoved by other processes' load); when it fires
the report is the arbiter's alone, and says so (the note and the JSON's hang_guard). The
arbiter scales its grid with the expression's size, so it is bounded too.
"""
from __future__ import annotations

import math
import signal
import threading
import time
from contextlib import contextmanager

from .arbiter import Arbiter
from .confirm import check_weight, compare_range, confirm_boundaries, domain_warnings
from .events import facts as grid_facts
from .extremes import on_policy, on_policy_warnings
from fractions import Fraction

from .ir import tree_size
from .operations import OPS
from .walks import derivative, numpy_plan, reads_whole_response, uniform_view
from .parser import Objective
from .sampling import Numeric, case_dispatch, numpy_fn, self_check  # noqa: F401 - self_check is this module's API too
from .symbolic import SIGNS, derive, full_weight, geometry, numeric_geometry

SYMBOLIC_SIZE = 800      # ∂ℓ/∂r written out as a tree (the library's largest: 231, kpop); past it, the arbiter alone
SYMBOLIC_POWER = 128     # a constant exponent (r^1000 takes SymPy seconds); past it, the arbiter alone
HANG_SECONDS = 20.0      # CPU seconds; a guard against a hang only: the library's slowest analysis takes about 1 s
# Work budgets, each on the size (nodes of the SymPy tree, `size`) of a step's input, counted
# before the step. Calibrated on the library, the golden table and the pathological set
# (benchmarks/analyze_speed.py): every shipped objective derives what it derived on a quiet
# machine under the former 0.5 s limit per step (kpop's w(1) = 1 more, its conditions now being
# simpler), and every pathological objective of up to 4 KB finishes within 2 s cold.
BUDGET = {
    "branches": 24,       # branch points of ∂ℓ/∂r (`branches`; the library's most: 17); past it, the arbiter alone
    "tidy": 400,          # cancel/expand/factor_terms of one formula (the library's largest: 31)
    "degree": 8,          # and its degree as a polynomial (`dsl.symbolic.degree`; the library's 6; 9 takes seconds)
    "simplify": 40,       # sp.simplify (w at r = 1, symmetry in log r): the library's largest 26; 75 took 4 s
    "limit": 60,          # sp.limit at a corner of the domain (the library's largest: 21)
    "limits": 12,         # limits taken per objective (the library's most: 9)
    "roots": 4,           # degree of each factor of w's numerator solved in closed form (the library's: 2)
    "solve": 300,         # nodes of w solved for w = 0 (the library's largest: 14)
    "settle": 600,        # conditions and relations settled for one case's weight (the library's most: 294,
                          # the hand-derived table's 221); past it, the arbiter alone
}


def size(e) -> int:
    """The number of nodes of a SymPy expression: the work counted against a budget."""
    from sympy import preorder_traversal
    return sum(1 for _ in preorder_traversal(e))


class OverBudget(Exception):
    """A step's input is larger than its budget: the step takes its fallback."""

    def __init__(self, what, n, budget):
        shown = {"roots": f"degree {n}", "settle": f"{n:,} settling steps"}.get(what, f"{n:,} nodes")
        super().__init__(f"{shown}, past the work budget of {budget:,}")
        self.n, self.budget = n, budget


class Unsettled(OverBudget):
    """Past the settling budget: a case's conditions would stay as built, so large that
    building and evaluating the weight costs seconds; the whole report is the arbiter's."""


def check_budget(key, n):
    if n > BUDGET[key]:
        raise (Unsettled if key == "settle" else OverBudget)(key, n, BUDGET[key])


class _Timeout(BaseException):
    """BaseException, so that no `except Exception` inside SymPy swallows it."""


_DEADLINES: list = []


@contextmanager
def _time_limit(seconds):
    # The hang guard counts this process's CPU time (ITIMER_PROF), not the wall clock: a hang
    # spends CPU, while a loaded machine only stretches the wall time of the same work, so the
    # guard fires on a hang and never because other processes compete for the cores. SIGPROF
    # interrupts pure-Python SymPy work. A nested limit never outlives the one around it; when
    # it ends, the outer one's timer is set again. Off the main thread: no limit.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    now = time.process_time()
    deadline = min(now + seconds, _DEADLINES[-1] if _DEADLINES else math.inf)

    def _raise(signum, frame):
        raise _Timeout()
    old = signal.signal(signal.SIGPROF, _raise)
    _DEADLINES.append(deadline)
    signal.setitimer(signal.ITIMER_PROF, max(deadline - now, 1e-4))
    try:
        yield
    finally:
        _DEADLINES.pop()
        if _DEADLINES:
            signal.setitimer(signal.ITIMER_PROF, max(_DEADLINES[-1] - time.process_time(), 1e-4))
        else:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.signal(signal.SIGPROF, old)


class _Ctx:
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
        self.deadline = time.process_time() + HANG_SECONDS
        self.guard = {"seconds": HANG_SECONDS, "fired": False}

    def hang(self, what):
        """The hang guard fired (never in a normal run): said in a note and in the JSON."""
        self.guard["fired"] = True
        self.note(f"{what}: the hang guard fired (SymPy ran past {HANG_SECONDS:g} s of CPU time, a limit far "
                  "above any normal run); the numeric arbiter's findings stand")

    def guarded(self, what, fn, default=None):
        """limited(), under what is left of the hang guard."""
        try:
            with _time_limit(max(self.deadline - time.process_time(), 1e-3)):
                return self.limited(what, fn, default)
        except _Timeout:
            self.hang(what)
            return default

    def tidy(self, e):
        from .symbolic import degree, tidy
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
        except _Timeout:
            raise
        except Exception as e:  # SymPy raises many types (NotImplementedError, RecursionError, ...)
            self.note(f"{what}: SymPy failed ({type(e).__name__}); used the fallback")
        return default


# ------------------------------------------------------------------ analysis
def analysis_view(obj: Objective, seq_len=1, rho=1) -> tuple[Objective, dict]:
    """The token-level objective in r, μ and A that is analysed, and what it stands for. A
    sequence objective is studied on a response whose tokens share r, μ and A (|y| = seq_len
    tokens): each reduction is its value there, r is the response's ratio, and every token's
    gradient is exactly the w·r·A derived for it. The policy μ is not is μ·ρ or μ/ρ, with ρ =
    π_old/π_rollout held at `rho`. Existing token-level objectives are unchanged."""
    names = obj.names()
    sequence = any(map(reads_whole_response, obj.expr.walk()))
    other = {"old": "pi_rollout", "rollout": "pi_old"}[obj.options["anchor"]]
    scope = {"sequence": sequence, "seq_len": seq_len if sequence else None,
             "mismatch": other in names, "rho": rho if other in names else None, "rho_name": None}
    if not sequence and not names & {"pi_old", "pi_rollout"}:
        return obj, scope
    rho_name = "rho" if "rho" not in obj.params else "rho_mismatch"
    expr = uniform_view(obj.expr, obj.options["anchor"], rho_name)
    used = {n.value for n in expr.walk() if n.op == "param"}
    params = dict(obj.params)
    for name, value in (("seq_len", seq_len), (rho_name, rho)):
        if name in used:
            params[name] = Fraction(value)
    scope["rho_name"] = rho_name if rho_name in used else None
    view = Objective(obj.name, obj.path, obj.source, expr, params, dict(obj.options), {}, obj.description)
    return view, scope


def analyze(obj: Objective, seq_len=1, rho=1) -> dict:
    original = obj
    obj, scope = analysis_view(obj, seq_len, rho)
    ctx = _Ctx(obj)
    arb = Arbiter(obj, ctx.dl)        # ∂ℓ/∂r derived once, for every numeric check
    facts = grid_facts(arb)
    result = {
        "name": obj.name, "path": obj.path, "description": obj.description,
        "params": {k: float(v) for k, v in obj.params.items()},
        "options": dict(obj.options),
        "objective": original.canonical().splitlines()[-1],
        "scope": scope,
    }
    if scope["rho_name"]:
        scope["mismatch_range"] = mismatch_range(obj, scope["rho_name"], ctx.dl)
    claims, why = None, None
    if (size := tree_size(ctx.dl)) > SYMBOLIC_SIZE:
        why = f"∂ℓ/∂r has {size:,} operations written out; SymPy is tried up to {SYMBOLIC_SIZE:,}"
    elif (power := _highest_power(ctx.dl)) > SYMBOLIC_POWER:
        why = f"∂ℓ/∂r has the power ^{power:g}; SymPy is tried up to ^{SYMBOLIC_POWER}"
    elif (n := branches(ctx.dl)) > BUDGET["branches"]:
        why = f"∂ℓ/∂r has {n} branch points (min, max, clip, masks, comparisons); SymPy is tried up to {BUDGET['branches']}"
    else:
        try:
            with _time_limit(HANG_SECONDS):
                claims = _symbolic_claims(ctx, arb, facts)
        except _Timeout:
            ctx.hang("the derivation")
            why = f"the hang guard fired at {HANG_SECONDS:g} s of CPU time"
        except RecursionError:
            why = "the expression is too deeply nested for SymPy"
        except Unsettled as e:
            why = f"settling one case's conditions took {e}"
    if why:
        ctx.notes.append(f"the weight is not derived symbolically ({why}): every finding below is the "
                         "numeric arbiter's")
    if claims is None:
        boundary, notes = confirm_boundaries(ctx, arb, facts, {adv: [] for adv, _ in SIGNS})
        claims = {"weight": None, "cases": [], "boundary": boundary, "range": facts["range"],
                  "exact_range": [False, False], "w": arb.w,
                  "geometry": numeric_geometry(arb, boundary), "weight_check": {"status": "not derived"}}
        ctx.notes += notes
    result.update({k: claims[k] for k in ("weight", "cases", "boundary", "geometry")})
    result["reachable"] = {adv: any(b["reachable"]) or bool(b["numeric"]) for adv, b in claims["boundary"].items()}
    result["on_policy"] = on_policy(obj, ctx.dl)
    if result["geometry"] == "none" and any(f["w"] != [1.0, 1.0] for f in result["on_policy"].values()):
        result["geometry"] = "other"    # w ≡ 1 off policy only (a mask at r = 1): not the plain surrogate
    _widen(facts, result["on_policy"])
    weight_range, range_held = compare_range(claims["range"], facts["range"])
    result["weight_range"] = weight_range or [None, None]
    result["bounded"] = None if weight_range is None else None not in weight_range     # None: unknown
    result["smooth"] = facts["continuous"] and not any(f["jumps"] for f in result["on_policy"].values())
    result["self_check"] = self_check(obj, claims["w"])
    kinds = [k for b in claims["boundary"].values() for k in b["kind"]]
    result["arbiter"] = {
        "points": facts["points"], "magnitudes": list(arb.magnitudes), "weight": claims["weight_check"],
        "boundary": ("numeric" if any(b["numeric"] for b in claims["boundary"].values()) else
                     "unconfirmed" if any("unconfirmed" in k for k in kinds) else "confirmed"),
        "range": "confirmed" if range_held else "disagrees", "range_derived": claims["range"],
        "smooth": "numeric",        # continuity is the arbiter's alone: jumps judged against w's local scale
        "poles": any(facts[adv]["poles"] for adv, _ in SIGNS),
    }
    result["claims"] = _claims(ctx, arb, result, facts)
    result["warnings"] = (_warnings(result, claims["exact_range"] if range_held else [False, False])
                          + domain_warnings(facts) + on_policy_warnings(result["on_policy"]))
    result["admissibility"] = admissibility(ctx, arb, result)
    result["notes"] = ctx.notes
    result["hang_guard"] = ctx.guard
    result["_w"] = claims["w"]      # vectorized w(r, μ, A) as derived, for callers' own checks
    result["_w_numeric"] = arb.w    # the same by the IR's float rules (nan where undefined): the plot's
    return result


# ------------------------------------------------------------------ what each claim rests on
# A claim of absence or a global property ("no boundary", "unreachable", "bounded", "smooth")
# is "proven" only from the derived weight (SymPy, confirmed by the arbiter); the grid alone
# is evidence, so such a claim is "unconfirmed" and carries where it was looked for. A claim
# of existence (a boundary met, a jump, a pole) rests on the points found: "found".
def grid_evidence(arb) -> str:
    np = arb.np
    r = arb.R[arb.inside]
    mags = ", ".join(dict.fromkeys(f"{m:g}" for m in arb.magnitudes))     # 2 ± 2e-6 read 2, once
    return (f"the arbiter's {int(arb.inside.sum()):,} grid points, μ ∈ [{float(arb.mu.min()):g}, {float(arb.mu.max()):g}], "
            f"r ∈ [{float(np.min(r)):g}, {float(np.max(r)):g}] with π ≤ 1, |A| ∈ {{{mags}}}")


def _side_pieces(ctx, res, adv):
    """The derived pieces of w for one sign of A (in t > 0, a = |A| > 0, μ > 0), or None where
    the weight is not derived or the arbiter does not confirm it."""
    if res["weight"] is None or res["arbiter"]["weight"]["status"] != "confirmed":
        return None
    # r < 1 is t < 1: t = 1/(1 + u) with u > 0 keeps that in SymPy's assumptions
    u = ctx.sp.Symbol("u", positive=True)
    return [e if c["_tmax"] is None else e.subs(ctx.t, 1 / (1 + u))
            for c in res["cases"] if c["advantage"] == adv for e, _ in c["_pieces"]]


def _pieces_sign(ctx, pieces):
    """+1 or −1 where SymPy shows every piece > 0 (or < 0) for all positive t (t < 1 where
    r < 1), a and μ, whatever its condition (a sufficient condition: the domain is smaller),
    0 where every piece is 0, else None."""
    if all(e == 0 for e in pieces):
        return 0
    sp = ctx.sp
    v = sp.Symbol("v", nonnegative=True)

    def one(e):
        """e's sign, or None: as it stands, else as one fraction with μ = 1/(1 + v) (μ ≤ 1,
        which SymPy's assumptions cannot hold) whose expanded numerator and denominator
        each have a sign (DRPO's 1 − 2μt/25 with t < 1 is (25uv + 25u + 25v + 23)/…)."""
        for s, test in ((1, lambda x: x.is_positive), (-1, lambda x: x.is_negative)):
            if test(e) is True:
                return s
        check_budget("tidy", size(e))
        num, den = (sp.expand(x) for x in sp.fraction(sp.together(e.subs(ctx.mu, 1 / (1 + v)))))
        signs = [1 if x.is_positive else -1 if x.is_negative else None for x in (num, den)]
        return None if None in signs else signs[0] * signs[1]

    def sign():
        found = {one(e) for e in pieces}
        return found.pop() if len(found) == 1 and None not in found else None
    return ctx.limited("the sign of w", sign, None)


def _absence(ctx, res, adv, grid, zero_everywhere) -> dict:
    """The claim for a sign of A with no boundary found: w ≡ 0 or no boundary, proven where
    SymPy gives every derived piece one sign and w(1) agrees (derived only here, where it can
    prove something: a degree-9 objective spent 1.4 s on it), else the grid's evidence."""
    pieces = _side_pieces(ctx, res, adv)
    sign = _pieces_sign(ctx, pieces) if pieces else None
    at_one = res["on_policy"][adv]
    one_ok = at_one["status"] != "undefined" and None not in at_one["w"] and (
        at_one["w"][0] > 0 if sign == 1 else at_one["w"][1] < 0 if sign == -1 else at_one["w"] == [0, 0])
    if sign == 0 and one_ok:
        return {"claim": "w ≡ 0", "status": "proven", "evidence": "every derived piece of w is 0"}
    if zero_everywhere:
        return {"claim": "w ≡ 0", "status": "unconfirmed", "evidence": f"w = 0 at all of {grid}"}
    if sign in (1, -1) and one_ok:
        return {"claim": "none", "status": "proven",
                "evidence": f"every derived piece of w is {'> 0' if sign > 0 else '< 0'} (SymPy), and so is w(1)"}
    return {"claim": "none", "status": "unconfirmed", "evidence": f"none found at {grid}"
            + (" nor on the symbolic zeros probed outside the domain" if res["weight"] is not None else "")}


def _claims(ctx, arb, res, facts) -> dict:
    grid = grid_evidence(arb)
    out = {"boundary": {}, "reachable": {}}
    for adv, _ in SIGNS:
        b, f = res["boundary"][adv], facts[adv]
        valid = arb.valid & ((arb.sign > 0) == (adv == "positive"))
        zero_everywhere = bool(valid.any()) and not arb.np.any(arb.W[valid] != 0)
        # w = 0 on a region: zeros with a zero neighbour along the row (an isolated 0 is a touch)
        z = valid & (arb.W == 0)
        zeros = int((z & (arb.np.pad(z[:, 1:], ((0, 0), (0, 1))) | arb.np.pad(z[:, :-1], ((0, 0), (1, 0))))).sum())
        if b["pi"] or b["numeric"]:
            claim = {"claim": "boundary", "status": "found" if any(b["reachable"]) or b["numeric"] else "unconfirmed",
                     "evidence": "w changes sign at the grid points located" if any(b["reachable"]) or b["numeric"]
                     else "w changes sign only on the symbolic zero's curve outside the domain (probed)"}
        else:
            claim = _absence(ctx, res, adv, grid, zero_everywhere)
        claim["touches"] = bool(f["touches"])
        claim["zero_share"] = zeros / max(1, int(valid.sum()))
        out["boundary"][adv] = claim
        reach = []
        for p, ok in zip(b["pi"], b["reachable"]):
            if ok:
                reach.append({"status": "found", "evidence": "met by w's sign changes on the grid"})
                continue
            proof = ctx.limited("the boundary lies outside the domain",
                                lambda: (p - 1).is_positive is True, False)
            reach.append({"status": "proven", "evidence": "π > 1 for every μ > 0 (SymPy)"} if proof else
                         {"status": "unconfirmed", "evidence": f"not met at {grid}; found only outside the domain"})
        out["reachable"][adv] = reach
    # every operation continuous in r where it stands (its row says; x^c only for c ≥ 0, ...) and
    # none that branches (min, max and clip are continuous, but their derivatives are not)
    continuous_ir = all(n.op not in OPS or (OPS[n.op].is_continuous(n) and not OPS[n.op].branching)
                        for n in ctx.dl.walk())
    continuous_ir &= not any(facts[adv]["poles"] or facts[adv]["undefined"] for adv, _ in SIGNS)
    if not res["smooth"]:
        out["smooth"] = {"status": "found", "evidence": "a jump or pole located by bisection on the grid"}
    elif continuous_ir:
        out["smooth"] = {"status": "proven", "evidence": "∂ℓ/∂r is built from continuous operations only "
                         "(no mask, clip, min, max, sign or division)"}
    else:
        out["smooth"] = {"status": "unconfirmed", "evidence": f"no jump or pole found at {grid}"}
    if res["bounded"] is None:
        out["bounded"] = {"status": "unconfirmed", "evidence": "w is not a finite double at any sampled point"}
    elif not res["bounded"]:
        out["bounded"] = {"status": "found", "evidence": "w grows toward a pole, an undefined edge or the domain's corners"}
    elif res["cases"] and res["arbiter"]["weight"]["status"] == "confirmed" and \
            all(e.is_number and e.is_finite for c in res["cases"] for e, _ in c["_pieces"]):
        out["bounded"] = {"status": "proven", "evidence": "every derived piece of w is a constant"}
    else:
        out["bounded"] = {"status": "unconfirmed", "evidence": f"the extremes of {grid}, refined between them, "
                          "and the corners μ, r → 0, π → 1"}
    return out


# ------------------------------------------------------------------ admissibility
# The properties the 2026 gate papers derive by hand for each new gate (smooth-gate, DGPO,
# REAL): w(1) = 1, boundedness, the two tails of w and its symmetry in log r.
TAIL_R = (1e-12, 1e12, 221)     # log-spaced: r → 0 at fixed μ; r → 1/μ along π = 1 as μ → 0
SYMMETRY_T = 400                # values of t = log r per μ for w(e^t) = w(e^−t)


def admissibility(ctx, arb, res) -> dict:
    """Each property with how it is known: 'derived' (SymPy, confirmed by the IR's float
    rules) or 'numeric' (the IR's float rules alone, on the samples stated)."""
    return {"w_at_1": _w_at_1(ctx, res), "bounded": {"value": res["bounded"], "range": res["weight_range"],
                                                       "status": "the range's (weight_range; arbiter.range)"},
            "tails": _tails(arb), "symmetric_log_r": _symmetric(ctx, arb, res)}


def _derived_weight(ctx, res, sign):
    """The derived one-line w at parameter values with A = sign·a, or None."""
    if res["weight"] is None or res["arbiter"]["weight"]["status"] != "confirmed":
        return None
    values = {ctx.param_syms[k]: v for k, v in ctx.param_vals.items()}
    return res["weight"].subs(values).subs(ctx.A, sign * ctx.a)


def _w_at_1(ctx, res) -> dict:
    facts = res["on_policy"]
    numeric = all(f["status"] == "ok" and abs(f["w"][0] - 1) <= 1e-9 and abs(f["w"][1] - 1) <= 1e-9
                  for f in facts.values())

    def derived():
        for sign in (1, -1):
            w = _derived_weight(ctx, res, sign)
            if w is None:
                return False
            at_1 = w.subs(ctx.r, 1)
            check_budget("simplify", size(at_1))
            if ctx.sp.simplify(at_1) != 1:
                return False
        return True
    proven = numeric and ctx.guarded("w at r = 1", derived, False)
    return {"value": numeric, "status": "derived" if proven else "numeric",
            "w": {adv: f["w"] for adv, f in facts.items()}}


def _tails(arb) -> dict:
    """Per sign of A, how w behaves as r → 0 (at each μ of the arbiter's MUS) and as r → 1/μ
    with π = 1 and μ → 0 (r → ∞), at each |A| the arbiter samples: classified from log|w|
    against log r along TAIL_R (numeric, the IR's float rules)."""
    import numpy as np
    from .arbiter import MUS
    rs = np.geomspace(*TAIL_R)
    lower, upper = rs[rs < 0.1][::-1], rs[rs > 10]
    out = {}
    for adv, sign in SIGNS:
        found = {"zero": [], "infinity": []}
        for mag in arb.magnitudes:
            for mu in MUS:
                found["zero"].append(_classify(lower, arb.w(lower, mu, sign * mag)))
            found["infinity"].append(_classify(upper, arb.w(upper, 1 / upper, sign * mag)))
        out[adv] = {k: _merge_tails(v) for k, v in found.items()}
    return {"by_sign": out, "status": "numeric",
            "samples": {"r": list(TAIL_R), "mu": list(MUS), "magnitudes": list(arb.magnitudes)}}


def _classify(x, w) -> dict:
    """x runs toward the limit (0 or ∞). The local slope of log|w| against log x says how
    w goes: ~0 with w settling (a constant), a steady −p (polynomial decay of order p), ever
    steeper (exponential); exact zeros after values near a double's underflow are a decay,
    after ordinary values a cut."""
    import numpy as np
    from .events import UNDERFLOW
    finite = np.isfinite(w)
    u = np.abs(np.log(x))       # grows toward the limit
    if not finite[-5:].all():
        if finite.any():
            k = np.nonzero(finite)[0][-1]
            if k > 5 and abs(w[k]) > 1e3 * max(1.0, abs(w[0])):
                return {"kind": "grows", "order": None, "sign": int(np.sign(w[k])), "past": float(x[k])}
        return {"kind": "undefined"}
    if (w[-5:] == 0).all():
        nz = np.nonzero(w != 0)[0]
        if nz.size and abs(w[nz[-1]]) < UNDERFLOW:
            return {"kind": "decays exponentially", "order": None, "underflows": float(x[nz[-1]])}
        return {"kind": "is 0 (cut off)", "order": None}
    tail = slice(len(x) - 30, len(x))       # the last ~1.5 decades of r
    with np.errstate(divide="ignore"):
        lw = np.log(np.abs(w))
    slope = np.diff(lw[tail]) / np.diff(u[tail])
    end = float(w[-1])
    if not np.isfinite(slope).all() or len(set(np.sign(w[tail]))) > 1:
        return {"kind": "changes sign", "order": None}
    if np.abs(slope).max() < 1e-3:
        return {"kind": "tends to a constant", "value": end}
    if abs(slope[-1]) > 5 and abs(slope[-1]) > 3 * abs(slope[0]):      # ever steeper: e^(∓c·r) or e^(∓c/r)
        return {"kind": "decays exponentially" if slope[-1] < 0 else "grows", "order": None,
                "sign": int(np.sign(end)), **({} if slope[-1] < 0 else {"note": "faster than any power"})}
    p = -float(slope[-5:].mean())
    if abs(p) < 0.05:
        return {"kind": "tends to a constant", "value": end, "note": "slowly (a logarithmic factor)"}
    return {"kind": "decays polynomially" if p > 0 else "grows", "order": round(abs(p), 2),
            "sign": int(np.sign(end)), "steady": bool(np.ptp(slope) <= 0.05 * max(1.0, abs(p)))}


def _merge_tails(found) -> dict:
    """One description over μ and |A|: a shared kind, with the span of its order or limit."""
    kinds = sorted({f["kind"] for f in found})
    if len(kinds) > 1:
        return {"kind": "varies", "kinds": kinds}
    out = {"kind": kinds[0]}
    if kinds[0] == "tends to a constant":
        vals = [f["value"] for f in found]
        out["value"] = [min(vals), max(vals)]
    orders = [f["order"] for f in found if f.get("order") is not None]
    if orders:
        out["order"] = [min(orders), max(orders)]
        out["steady"] = all(f.get("steady", True) for f in found)
    signs = {f.get("sign") for f in found if f.get("sign")}
    out["sign"] = signs.pop() if len(signs) == 1 else None
    notes = sorted({f["note"] for f in found if f.get("note")})
    # where a double gives out first along the path: w overflows (ℓ with it) or underflows to 0
    for key, text in (("past", "not a finite double past r ≈ {:.3g}"), ("underflows", "underflows to 0 past r ≈ {:.3g}")):
        xs = [f[key] for f in found if key in f]
        if xs:
            notes.append(text.format(min(xs, key=lambda x: abs(math.log(x)))))
    out["note"] = "; ".join(notes) if notes else None
    return out


def _symmetric(ctx, arb, res) -> dict:
    """w(e^t) = w(e^−t) for each sign of A, wherever both ratios lie in the domain (e^t ≤ 1/μ),
    on the arbiter's μ and |A|; derived as well where SymPy reduces the difference of the
    one-line w to 0."""
    import numpy as np
    from .arbiter import MUS
    by = {}
    for adv, sign in SIGNS:
        worst, gap = None, 0.0
        for mu in MUS[:-1]:           # at μ = 1 no r > 1 is in the domain
            t = np.linspace(0, -np.log(mu), SYMMETRY_T + 1)[1:]
            for mag in arb.magnitudes:
                a, b = arb.w(np.exp(t), mu, sign * mag), arb.w(np.exp(-t), mu, sign * mag)
                with np.errstate(invalid="ignore"):
                    rel = np.abs(a - b) / np.fmax(1.0, np.fmax(np.abs(a), np.abs(b)))
                rel = np.where(np.isnan(a) != np.isnan(b), np.inf, np.nan_to_num(rel, nan=0.0))
                k = int(np.argmax(rel))
                if rel[k] > max(gap, 1e-6):       # the example is the largest difference
                    gap = float(rel[k])
                    worst = {"mu": float(mu), "A": float(sign * mag), "r": float(np.exp(t[k])),
                             "w": [None if np.isnan(x) else float(x) for x in (a[k], b[k])]}   # None: undefined
        by[adv] = {"value": worst is None, "example": worst}

    def derived():
        for sign in (1, -1):
            w = _derived_weight(ctx, res, sign)
            if w is None or w.has(ctx.sp.Piecewise):
                return False
            x = ctx.sp.Symbol("x", real=True)
            gap = w.subs(ctx.r, ctx.sp.exp(x)) - w.subs(ctx.r, ctx.sp.exp(-x))
            check_budget("simplify", size(gap))
            if ctx.sp.simplify(gap) != 0:
                return False
        return True
    value = all(b["value"] for b in by.values())
    proven = value and ctx.guarded("symmetry in log r", derived, False)
    return {"value": value, "by_sign": by, "status": "derived" if proven else "numeric"}


MISMATCH_GRID = (1e-4, 1e4, 801)      # ρ = π_old/π_rollout, log-spaced


def mismatch_range(view: Objective, rho_name: str, dl) -> dict:
    """On policy (r = 1), over μ in [1e-6, 1], A = ±1 and ρ on MISMATCH_GRID: the range of w
    and the ρ where some token keeps a nonzero weight (outside it the objective filters it)."""
    import numpy as np
    rho = np.geomspace(*MISMATCH_GRID)
    mu = np.geomspace(1e-6, 1, 31)[:, None]
    run = numpy_plan(dl)
    params = {k: float(v) for k, v in view.params.items()}
    ws = [run({**params, "r": np.ones_like(mu), "mu": mu, "pi": mu, "A": a, rho_name: rho[None, :]})[0] / a
          for a in (1.0, -1.0)]
    w = np.broadcast_to(np.stack(ws), (2, mu.shape[0], rho.size))
    finite = w[np.isfinite(w)]
    kept = rho[np.any(np.isfinite(w) & (w != 0), axis=(0, 1))]
    return {"w": [float(finite.min()), float(finite.max())] if finite.size else [None, None],
            "kept": [float(kept.min()), float(kept.max())] if kept.size else None,
            "grid": list(MISMATCH_GRID), "status": "numeric"}


def _highest_power(n) -> float:
    return max((abs(float(m.args[1].value)) for m in n.walk() if m.op == "pow" and m.args[1].op == "num"),
               default=0.0)


def branches(n) -> int:
    """Nodes of ∂ℓ/∂r where w may branch (min, max, clip, masks, comparisons, and, or, not):
    the cases SymPy must settle grow with their product."""
    return sum(1 for m in set(n.walk()) if m.op in OPS and OPS[m.op].branching)


def _widen(facts, on_policy_facts):
    """r = 1 is not on the arbiter's grid (it has its own check): its w belongs in the range."""
    rng = facts["range"]
    for f in on_policy_facts.values():
        lo, hi = f["w"]
        if rng is not None and lo is not None:
            rng[0] = None if rng[0] is None else min(rng[0], lo)
            rng[1] = None if rng[1] is None else max(rng[1], hi)


def _symbolic_claims(ctx, arb, facts) -> dict:
    """The derivation's claims, each boundary already confirmed or dropped by the arbiter."""
    cases, candidates, entangled = derive(ctx)
    w = case_dispatch(ctx, cases)
    boundary, notes = confirm_boundaries(ctx, arb, facts, candidates)
    ctx.notes += notes
    num = Numeric(ctx, w, cases, entangled)
    sampled, exact = num.weight_range()
    weight = full_weight(ctx, cases)
    # the one-line w is printed too: checked like the cases (for a smooth objective it is
    # derived on its own, with the parameters symbolic)
    values = {ctx.param_syms[k]: v for k, v in ctx.param_vals.items()}
    checks = [check_weight(arb, w)]
    try:
        whole = numpy_fn([ctx.r, ctx.mu, ctx.A], weight.subs(values))
        checks.append(check_weight(arb, whole))
    except NotImplementedError:     # a function numpy lacks (LambertW): the cases' check stands
        pass
    worst = next((c for c in checks if c["status"] == "disagrees"), checks[0])
    return {"weight": weight, "cases": cases, "boundary": boundary, "range": sampled,
            "exact_range": exact, "w": w, "geometry": geometry(ctx, cases, boundary, entangled),
            "weight_check": worst}


def _how(claims) -> str:
    """A warning's claim of absence says whether it is proven; the evidence is printed once, under
    the boundary it concerns."""
    proven = all(c["status"] == "proven" for c in claims)
    return " (proven)" if proven else " (unconfirmed: evidence under the boundary above)"


def _warnings(res, exact_range):
    from .report import _fmt, math_text
    out = []
    lo, hi = res["weight_range"]
    for adv, sign_text in (("positive", "A > 0"), ("negative", "A < 0")):
        b = res["boundary"][adv]
        if not b["pi"] and not b["numeric"]:
            c = res["claims"]["boundary"][adv]
            how = _how([c])
            if c["claim"] == "w ≡ 0":
                out.append(f"for {sign_text}, w = 0 everywhere: these tokens get no gradient at all{how}")
            elif c["zero_share"] > 0:
                out.append(f"no trust-region boundary for {sign_text}, but w = 0 on part of the domain "
                           f"({100 * c['zero_share']:.3g}% of the grid points): those tokens get no gradient{how}")
            elif res["on_policy"][adv]["status"] == "zero":
                out.append(f"no trust-region boundary for {sign_text}: w = 0 at r = 1 (see on policy) but does not "
                           f"change sign, so nothing stops the update{how}")
            elif c["touches"]:
                out.append(f"no trust-region boundary for {sign_text}: w reaches 0 only where it touches 0, "
                           f"so nothing stops the update{how}")
            elif res["geometry"] != "none":
                out.append(f"no trust-region boundary for {sign_text}: w never reaches 0, so nothing stops the update{how}")
        elif not res["reachable"][adv]:
            shown = ", ".join(f"π = {math_text(p)}" for p in b["pi"])
            out.append(f"the boundary for {sign_text} ({shown}) is unreachable: 0 < π, μ ≤ 1, "
                       f"so w stays within [{_fmt(lo)}, {_fmt(hi)}] and never cancels the gradient"
                       + _how(res["claims"]["reachable"][adv]))
        elif not all(b["reachable"]):
            shown = ", ".join(f"π = {math_text(p)}" for p, ok in zip(b["pi"], b["reachable"]) if not ok)
            how = [c for c, ok in zip(res["claims"]["reachable"][adv], b["reachable"]) if not ok]
            out.append(f"for {sign_text}, the boundary {shown} is unreachable in 0 < π, μ ≤ 1" + _how(how))
        if b["numeric"]:
            found = "; ".join(f"{x['where']} ({x['kind']})" for x in b["numeric"])
            out.append(f"for {sign_text}, the numeric arbiter finds w changing sign at {found}" +
                       (": the symbolic derivation found no boundary there" if res["weight"] is not None else ""))
    if res["bounded"] is None:
        out.append("w is not a finite double at any sampled point: its range is unknown")
    elif not res["bounded"]:
        out.append(f"w is unbounded (range [{_fmt(lo)}, {_fmt(hi)}]): tokens with extreme ratios "
                   "(rare tokens, small μ) can dominate the gradient")
    if res["geometry"] == "advantage-entangled":
        out.append("the weight depends on |A|: the trust region moves with the advantage's magnitude")
    if not all(exact_range) and None not in (lo, hi):
        out.append("the range is numeric (sampled over the domain), not an exact bound")
    wc = res["arbiter"]["weight"]
    if wc["status"] == "disagrees":
        x = wc["example"]
        out.append(f"THE DERIVED WEIGHT DISAGREES with the IR's own derivative at {wc['bad_points']} of "
                   f"{wc['points']} grid points, e.g. μ = {x['mu']:.6g}, π = {x['pi']:.6g}, A = {x['A']:g}: "
                   f"derived {x['derived']:.6g}, numeric {x['numeric']:.6g}")
    if res["arbiter"]["range"] == "disagrees":
        out.append("the derived range disagreed with the numeric arbiter (whose extremes are refined between "
                   "grid points); the arbiter's is shown")
    if res["self_check"]["status"] == "failed":
        out.append("SELF-CHECK FAILED: the derived weight disagrees with finite differences of the objective")
    elif res["self_check"]["status"] == "unconfirmed":
        out.append("the weight is unconfirmed: too few points where the objective is a finite double to check it")
    return out


# ------------------------------------------------------------------ output helpers
def to_json(res: dict) -> dict:
    """The JSON form: SymPy strings that sympify reads back over r, mu, A and params."""
    import sympy as sp

    from .report import math_text
    s = lambda e: sp.sstr(e)
    return {
        "name": res["name"], "params": res["params"], "options": res["options"],
        # names SymPy would read as its own (E, I, N, S, O, Q, beta, gamma, pi, ...) read back as
        # symbols with sympy.sympify(text, locals={n: sympy.Symbol(n) for n in symbols})
        "symbols": ["r", "mu", "A", *res["params"]],
        "scope": res["scope"],
        "objective": res["objective"], "weight": s(res["weight"]),
        "cases": [{"advantage": c["advantage"], "direction": c["direction"], "weight": s(c["weight"])}
                  for c in res["cases"]],
        "boundary": {adv: {"r": [s(e) for e in b["r"]], "pi": [s(e) for e in b["pi"]], "kind": b["kind"],
                           "reachable": b["reachable"], "numeric": b["numeric"], "where": b["where"]}
                     for adv, b in res["boundary"].items()},
        "reachable": res["reachable"],
        # per claim: "proven" (symbolic), "found" (located points), "unconfirmed" (the evidence given)
        "claims": res["claims"],
        "weight_range": [None if v is None else float(v) for v in res["weight_range"]],
        "bounded": res["bounded"], "smooth": res["smooth"], "geometry": res["geometry"],
        "on_policy": res["on_policy"], "arbiter": res["arbiter"],
        "warnings": res["warnings"], "self_check": res["self_check"], "admissibility": res["admissibility"],
        "notes": res["notes"], "hang_guard": res["hang_guard"],
        # the same formulas as the report prints them (readable math, never SymPy's calls)
        "text": {"weight": None if res["weight"] is None else math_text(res["weight"], weight=True),
                 "cases": [math_text(c["weight"], weight=True) for c in res["cases"]],
                 "boundary": {adv: {"r": [math_text(e) for e in b["r"]], "pi": [math_text(e) for e in b["pi"]]}
                              for adv, b in res["boundary"].items()}},
    }
