"""Do two objectives train identically? They do when their options (anchor, aggregation)
are the same and their per-token gradients ∂ℓ/∂log π = r·∂ℓ/∂r agree everywhere on the
domain; the losses may differ by a term without a gradient.

Both ∂ℓ/∂r come from the IR's own derivative rules (the compiled loss's). The symbolic side
subtracts them and settles the difference case by case (analysis.symbolic.derivation's A = ±a, r = 1 ± t);
the numeric side evaluates both on the arbiter's grid (more |A|, r = 1 and π = 1 included)
and on seeded random points, always: it alone finds a witness, and it confirms a proof.
"""
from __future__ import annotations

from openrlhf_drpo.analysis import budgets
from openrlhf_drpo.analysis.numeric.arbiter import grid_axes
from openrlhf_drpo.analysis.budgets import SYMBOLIC_POWER, SYMBOLIC_SIZE, Timeout, highest_power, time_limit
from openrlhf_drpo.analysis.symbolic.context import Ctx
from openrlhf_drpo.analysis.numeric.events import describe
from dsl.ir import Node, num, rebuild, sub, tree_size
from openrlhf_drpo.analysis.mathtext import math_text
from openrlhf_drpo.analysis.symbolic.derivation import DIRECTIONS, SIGNS, case_weight
from openrlhf_drpo.analysis.batch.held import held_group
from openrlhf_drpo.analysis.batch.scenarios import at, derive
from openrlhf_drpo.analysis.batch.view import analysis_view, held_names
from dsl.errors import DslError
from dsl.walks import derivative, numpy_plan

# |A| from tiny to huge, with intermediate values where an |A|-entangled gate changes shape
MAGNITUDES = (1e-3, 1.0, 1.5, 7.0, 60.0, 1e3)
RTOL = 1e-6          # |g_a − g_b| ≤ RTOL·max(|g_a|, |g_b|) + FLOOR·r·|A|: the same gradient
FLOOR = 1e-12
TIE = 1e-9           # a difference gone at r·(1 ± TIE) on both sides is a tie at a threshold
RANDOM_POINTS = 20000
SIMPLIFY_OPS = 200   # work budget: sp.simplify is tried on a case's difference up to this many operations
# ρ = π_old/π_rollout is part of a mismatch objective's domain: its gradient is compared at each
# of these (and at --rho), from a rollout engine far below the trainer to far above it
RHOS = (1e-2, 0.2, 0.5, 1.0, 2.0, 5.0, 100.0)


def _inline(n: Node, params: dict) -> Node:
    """n with each parameter replaced by its value: the two objectives may name different
    things alike (ε is 0.2 in one, 0.28 in the other)."""
    return rebuild(n, lambda m, args: num(params[m.value]) if m.op == "param" else None)


def equivalence(a, b, seq_len=1, rho=1, group=None) -> dict:
    """The verdict, its evidence and (when they differ) a witness and the region; at the held
    `group` (--group) where given, and on every scenario of either (scenario_verdicts): equivalent
    only where they agree on all of them."""
    views = [analysis_view(o, seq_len, rho, group=group) for o in (a, b)]
    names = [a.name, b.name] if a.name != b.name else [a.path, b.path]
    if names[0] == names[1]:
        names = [f"{names[0]} (first)", f"{names[0]} (second)"]
    options = [{"option": k, "values": [a.options[k], b.options[k]]} for k in a.options if a.options[k] != b.options[k]]
    scopes = [s for _, s in views]
    mismatch = any(s["mismatch"] for s in scopes)
    rhos = sorted({float(rho), *RHOS}) if mismatch else [float(rho)]
    for x in sorted(rhos, key=lambda x: x != rho):      # --rho first: its symbolic proof is the one shown
        at = views if x == rho else [analysis_view(o, seq_len, x) for o in (a, b)]
        exprs = [_inline(v.expr, v.params) for v, _ in at]
        dls = [_inline(derivative(v.expr), v.params) for v, _ in at]
        if x == rho:
            symbolic = _symbolically(views[0][0], dls)
        numeric = _numerically(exprs, dls)
        if numeric["differs"]:
            numeric["witness"]["rho"] = x
            break
    numeric["rhos"] = rhos if mismatch else None
    gradient_same = not numeric["differs"]
    situations = scenario_verdicts(a, b, seq_len, rho, group)
    differ = [s for s in situations if s["status"] == "differs"]
    return {
        "names": names, "paths": [a.path, b.path],
        "equivalent": gradient_same and not options and not differ and all(s["status"] == "same" for s in situations),
        "scenarios": situations, "group": None if group is None else [float(c) for c in group],
        "gradient_equivalent": gradient_same, "options": options,
        "options_shown": {k: a.options[k] for k in a.options},
        "scope": {"sequence": any(s["sequence"] for s in scopes), "seq_len": seq_len, "mismatch": mismatch,
                  "rho": rho},
        "symbolic": symbolic, "numeric": numeric,
    }


# ------------------------------------------------------------------ over the scenarios
def scenario_verdicts(a, b, seq_len, rho, group) -> list[dict]:
    """Each scenario of either objective (analysis.batch.scenarios, by name: both derive it alike), the
    two gradients compared at its held point as at the analysed one: 'same', 'differs' (with the
    witness, and where its group's advantages are all equal, whether the two agree at A = 0, what a
    host that normalizes A within groups gives there), or 'not compared' (why)."""
    point = {"seq_len": seq_len, "group": group}
    found = {s.name: s for o in (a, b) for s in derive(o, point)}
    out = []
    for s in found.values():
        p = at(point, s)
        kw = {k: p.get(k) for k in ("group_size", "batch_size", "position", "group")}
        held = {k: v for k, v in p.get("held", {}).items()}
        try:
            at_views = [analysis_view(o, p.get("seq_len", 1), rho, **kw, held={k: v for k, v in held.items()
                                                                                if k in held_names(o)})[0]
                        for o in (a, b)]
        except (DslError, ValueError) as e:
            out.append({"name": s.name, "title": s.title, "status": "not compared", "why": str(e).splitlines()[0]})
            continue
        exprs = [_inline(v.expr, v.params) for v in at_views]
        dls = [_inline(derivative(v.expr), v.params) for v in at_views]
        numeric = _numerically(exprs, dls)
        row = {"name": s.name, "title": s.title, "status": "differs" if numeric["differs"] else "same",
               "points": numeric["points"]}
        if numeric["differs"]:
            row["witness"] = numeric["witness"]
            g = held_group(kw.get("group_size"), kw.get("group"))
            if len(set(g)) == 1:     # a host normalizing A within groups gives A = 0 on every response here
                import numpy as np
                r, mu, _, _ = _points(1)
                zero = _gradients(exprs, dls, r, mu, np.zeros_like(r))
                row["normalized_same"] = not bool(_differ(*zero, r, np.ones_like(r)).any())
        out.append(row)
    return out


# ------------------------------------------------------------------ numerically
def _points(nodes: int):
    """(r, μ, A) flat: the arbiter's grid over 0 < μ ≤ 1, 0 < π ≤ 1 with r = 1 and π = 1
    added, for both signs of A and every |A| of MAGNITUDES, then seeded random points."""
    import numpy as np
    mus, base = grid_axes(nodes, len(MAGNITUDES))
    rows = []
    for mu in mus:
        r = np.unique(np.concatenate([base[base * mu <= 1], [1.0, 1 / mu]]))
        rows.append(np.stack([r, np.full_like(r, mu)]))
    grid = np.concatenate(rows, axis=1)
    A = np.repeat(np.concatenate([np.array(MAGNITUDES), -np.array(MAGNITUDES)]), grid.shape[1])
    r, mu = np.tile(grid[0], 2 * len(MAGNITUDES)), np.tile(grid[1], 2 * len(MAGNITUDES))
    rng = np.random.default_rng(0)
    mu_x = 10 ** rng.uniform(-6, 0, RANDOM_POINTS)
    pi_x = np.where(rng.random(RANDOM_POINTS) < 0.5, 10 ** rng.uniform(-8, 0, RANDOM_POINTS),
                    rng.uniform(1e-9, 1, RANDOM_POINTS))
    A_x = rng.choice([-1.0, 1.0], RANDOM_POINTS) * 10 ** rng.uniform(-3, 3, RANDOM_POINTS)
    return (np.concatenate([r, pi_x / mu_x]), np.concatenate([mu, mu_x]), np.concatenate([A, A_x]),
            int(r.size))


def _gradients(exprs, dls, r, mu, A):
    """∂ℓ/∂log π = r·∂ℓ/∂r of each objective, nan where ℓ or the gradient is not a finite double."""
    import numpy as np
    out = []
    for e, d in zip(exprs, dls):
        ell, dl = numpy_plan(e, d)({"r": r, "mu": mu, "pi": mu * r, "A": A})
        with np.errstate(all="ignore"):
            g = r * np.broadcast_to(dl, r.shape)
            out.append(np.where(np.isfinite(np.broadcast_to(ell, r.shape)) & np.isfinite(g), g, np.nan))
    return out


def _differ(ga, gb, r, A):
    import numpy as np
    with np.errstate(all="ignore"):
        apart = np.abs(ga - gb) > RTOL * np.fmax(np.abs(ga), np.abs(gb)) + FLOOR * r * np.abs(A)
    return (np.isnan(ga) != np.isnan(gb)) | (apart & ~np.isnan(ga))


def _numerically(exprs, dls) -> dict:
    import numpy as np
    nodes = len(set().union(*(set(x.walk()) for x in (*exprs, *dls))))
    r, mu, A, on_grid = _points(nodes)
    ga, gb = _gradients(exprs, dls, r, mu, A)
    bad = _differ(ga, gb, r, A)
    # a difference at one threshold only (≤ against <) is a tie, not a region; except at r = 1,
    # where every step's first mini-batch sits
    i = np.nonzero(bad)[0]
    left, right = (_differ(*_gradients(exprs, dls, r[i] * step, mu[i], A[i]), r[i] * step, A[i])
                   for step in (1 - TIE, 1 + TIE))
    kept = left | right | (r[i] == 1.0)
    interior = np.zeros(r.shape, dtype=bool)
    interior[i] = left & right
    ties = i[~kept]
    bad[ties] = False
    out = {"points": int(r.size), "grid_points": on_grid, "random_points": int(r.size - on_grid),
           "magnitudes": list(MAGNITUDES), "rtol": RTOL, "differs": bool(bad.any()),
           "differing_points": int(bad.sum()), "only_on_policy": bool(bad.any() and (r[bad] == 1.0).all()),
           "ties": _where_ties(r[ties], mu[ties]) if ties.size else None}
    if not bad.any():
        return out
    with np.errstate(all="ignore"):
        rel = np.abs(ga - gb) / np.fmax(np.fmax(np.abs(ga), np.abs(gb)), FLOOR * r * np.abs(A))
    rel = np.where(bad & np.isfinite(rel), rel, -1.0)
    # the largest discrepancy; among near-equal ones (a mask: all of them), the most ordinary
    # token: r, |A| nearest 1 and μ nearest 0.5
    top = rel >= (0.999 * rel.max() if rel.max() > 0 else 0.0) if rel.max() >= 0 else bad
    top = top & interior if (top & interior).any() else top     # not on a threshold itself
    with np.errstate(all="ignore"):
        plain = np.abs(np.log(r)) + np.abs(np.log(np.abs(A))) + np.abs(np.log(mu / 0.5))
    k = int(np.argmin(np.where(top, plain, np.inf)))
    out["witness"] = {"mu": float(mu[k]), "pi": float(mu[k] * r[k]), "r": float(r[k]), "A": float(A[k]),
                      "gradients": [None if np.isnan(g[k]) else float(g[k]) + 0.0 for g in (ga, gb)]}
    out["region"] = {}
    for adv, sign in (("positive", 1), ("negative", -1)):
        m = bad & (np.sign(A) == sign)
        if not m.any():
            out["region"][adv] = None
            continue
        # below and above r = 1 apart: a clip's two sides are two regions
        spans = [[float(r[m & side].min()), float(r[m & side].max())] for side in (r < 1, r >= 1)
                 if (m & side).any()]
        out["region"][adv] = {
            "r": spans, "pi": [float((mu * r)[m].min()), float((mu * r)[m].max())],
            "mu": [float(mu[m].min()), float(mu[m].max())],
            "magnitudes": [float(x) for x in np.unique(np.abs(A[:on_grid][m[:on_grid]]))],
            "share": float(m.sum() / max(1, (np.sign(A) == sign).sum())),
            "undefined_in": [bool((m & np.isnan(g)).any()) for g in (ga, gb)],
            "on_policy": bool((m & (r == 1.0)).any()),
        }
    return out


def _where_ties(r, mu) -> str:
    return describe([{"r": float(x), "mu": float(m)} for x, m in zip(r, mu)])


# ------------------------------------------------------------------ symbolically
def _symbolically(view, dls) -> dict:
    """∂ℓ_a/∂r − ∂ℓ_b/∂r in each case (A ≷ 0 × r ≷ 1), settled as analysis.symbolic.derivation settles a
    weight: 'proven' when every piece is 0 (or nonzero only on a tie t = c), else the first
    case where it is not, with the difference as SymPy left it."""
    diff = sub(dls[0], dls[1])
    if (size := tree_size(diff)) > SYMBOLIC_SIZE:
        return {"status": "not tried", "why": f"the difference has {size:,} operations written out; "
                                              f"SymPy is tried up to {SYMBOLIC_SIZE:,}"}
    if highest_power(diff) > SYMBOLIC_POWER:
        return {"status": "not tried", "why": f"the difference has a power above ^{SYMBOLIC_POWER}"}
    ctx = Ctx(view)
    ctx.dl = diff
    sp = ctx.sp
    ties = []
    try:
        with time_limit(budgets.HANG_SECONDS):      # a hang guard only: the numeric comparison runs regardless
            for adv, sign in SIGNS:
                for direction in DIRECTIONS:
                    s, _, pieces = case_weight(ctx, sign, direction)
                    for expr, cond in pieces:
                        if expr != 0 and sp.count_ops(expr) <= SIMPLIFY_OPS:
                            # in r and μ (positive symbols), so that log(μ·r) = log(μ) + log(r)
                            in_r = expr.subs(ctx.t, s * (ctx.r - 1))
                            expr = ctx.limited("simplifying the difference",
                                               lambda: sp.simplify(sp.expand_log(in_r)), expr)
                        if expr == 0:
                            continue
                        at = _only_at(sp, ctx.t, cond)
                        if at:
                            ties += [x for x in (math_text(1 + s * c) for c in at) if x not in ties]
                            continue
                        back = {ctx.t: s * (ctx.r - 1), ctx.a: sign * ctx.A}     # (expr may be in t or r)
                        return {"status": "not proven", "advantage": adv, "direction": direction,
                                "difference": math_text(ctx.sp.sympify(expr * sign * ctx.a).subs(back)),
                                "why": "the difference of ∂ℓ/∂r does not simplify to 0 there"}
    except (Timeout, RecursionError):
        return {"status": "not proven", "why": f"the hang guard fired: SymPy ran past {budgets.HANG_SECONDS:g} s of CPU time"}
    except Exception as e:      # noqa: BLE001 - SymPy raises many types; the numeric comparison stands
        return {"status": "not proven", "why": f"SymPy failed ({type(e).__name__})"}
    if any(n.startswith("settling") for n in ctx.notes):
        return {"status": "not proven", "why": "SymPy could not settle a case's conditions within its work budget"}
    return {"status": "proven", "ties": ties}


def _only_at(sp, t, cond):
    """The thresholds c where a settled condition (relations t ⋚ c) holds, when it holds
    nowhere between them (t ≥ c and t ≤ c): a tie, not a region. None otherwise."""
    rels = cond.atoms(sp.core.relational.Relational)
    if not rels or any(rel.lhs != t for rel in rels):
        return None
    cs = sorted({rel.rhs for rel in rels}, key=sp.default_sort_key)
    e = sp.Dummy("e", positive=True)
    if len(cs) == 1:
        probes = [cs[0] - e, cs[0] + e]
    elif all(c.is_number for c in cs):
        cs = sorted(cs, key=float)
        probes = [cs[0] / 2, cs[-1] + 1] + [(x + y) / 2 for x, y in zip(cs, cs[1:])]
    else:
        return None
    if any(cond.xreplace({t: x}) != sp.false for x in probes):
        return None
    return [c for c in cs if cond.xreplace({t: c}) == sp.true] or None
