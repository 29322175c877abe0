"""The analysis's work budgets: the bottom of the analysis, importing none of it.

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
    "degree": 8,          # and its degree as a polynomial (`openrlhf_drpo.analysis.symbolic.context.degree`; the library's 6; 9 takes seconds)
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


# ------------------------------------------------------------------ budgets on the IR itself
def highest_power(n) -> float:
    """The largest constant exponent in an IR expression (SYMBOLIC_POWER's measure)."""
    return max((abs(float(m.args[1].value)) for m in n.walk() if m.op == "pow" and m.args[1].op == "num"),
               default=0.0)


def branches(n) -> int:
    """Nodes of ∂ℓ/∂r where w may branch (min, max, clip, masks, comparisons, and, or, not):
    the cases SymPy must settle grow with their product."""
    from dsl.operations import OPS
    return sum(1 for m in set(n.walk()) if m.op in OPS and OPS[m.op].branching)


# ------------------------------------------------------------------ the hang guard
class Timeout(BaseException):
    """BaseException, so that no `except Exception` inside SymPy swallows it."""


_DEADLINES: list = []


@contextmanager
def time_limit(seconds):
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
        raise Timeout()
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
