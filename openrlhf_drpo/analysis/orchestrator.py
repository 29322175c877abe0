"""What an objective does to each token's gradient: the symbolic derivation (analysis.symbolic.derivation)
and the numeric arbiter (analysis.numeric.arbiter, analysis.numeric.events, analysis.numeric.extremes), joined where each claim
is confirmed (analysis.symbolic.confirm), with what each claim rests on (analysis.claims), the admissibility
properties (analysis.admissibility) and the warnings (analysis.alerts). Every step is bounded by work
budgets, never by the clock (analysis.budgets)."""
from __future__ import annotations

from openrlhf_drpo.analysis import budgets
from openrlhf_drpo.analysis.admissibility import admissibility, limits, tails
from openrlhf_drpo.analysis.batch.advantage import describe, held_value, uniform_point
from openrlhf_drpo.analysis.batch.advantage import own_advantage as find_advantage
from openrlhf_drpo.analysis.alerts import Alert, domain_alerts, level_alerts, on_policy_alerts, result_alerts
from openrlhf_drpo.analysis.numeric.arbiter import Arbiter
from openrlhf_drpo.analysis.budgets import BUDGET, SYMBOLIC_POWER, SYMBOLIC_SIZE, Timeout, Unsettled, branches, highest_power, time_limit
from openrlhf_drpo.analysis.symbolic.channels import entropy_channel, reference_channel
from openrlhf_drpo.analysis.claims import claims as claim_evidence
from openrlhf_drpo.analysis.memory import memory as over_memory
from openrlhf_drpo.analysis.symbolic.confirm import check_weight, compare_range, confirm_boundaries, settle_zero_weight
from openrlhf_drpo.analysis.symbolic.context import Ctx
from openrlhf_drpo.analysis.numeric.events import facts as grid_facts
from openrlhf_drpo.analysis.numeric.extremes import on_policy
from dsl.ir import Pos, tree_size
from dsl.objective import Objective
from openrlhf_drpo.analysis.result import Analysis
from openrlhf_drpo.analysis.numeric.sampling import Numeric, case_dispatch, numpy_fn, self_check
from openrlhf_drpo.analysis.symbolic.derivation import SIGNS, derive, full_weight, geometry, numeric_geometry
from openrlhf_drpo.analysis.batch.held import equal_group, held_group, spread
from openrlhf_drpo.analysis.batch.view import (analysis_view, locality_of, mismatch_range, moved_view, names_of_view,
                                         reference_split, terms)
from dsl.operations import OPS
from dsl.printing import render
from openrlhf_drpo.analysis.batch.scenarios import at, find, replaced, scenario_analysis
from dsl.vocabulary import refuse_r_analysis
from dsl.errors import DslError
from dsl.walks import NotHeld, derivative
from dsl.names import display_name


def analyze(obj: Objective, seq_len=1, rho=1, own_advantage=True, scenario: str | None = None,
            check_loss: bool = False, memory: bool = True, **point) -> Analysis:
    """The analysis of one objective (at |y| = seq_len and ρ = rho where it reads them, and on the
    uniform batch `point` sets: group_size, batch_size, position and the `held` values, as
    analysis.batch.view.analysis_view takes them), or at its `scenario` (analysis.batch.scenarios, by name):
    each step adds to `result` the fields the next ones read, and the typed result is built last.
    own_advantage=False: w against the host's A even where the objective builds its own advantage Â
    (analysis.batch.advantage). `check_loss`: hold each scenario's claim to the compiled loss (imports torch).
    An objective with memory is analysed again over its controls' bounds and its schedule's steps
    (analysis.memory), unless `memory` is False."""
    refuse_r_analysis(obj)       # a vocabulary sum is no function of r: say so, claim nothing
    original = obj
    again = {"seq_len": seq_len, "rho": rho, "own_advantage": own_advantage, "scenario": scenario, **point}
    given = {"seq_len": seq_len, **point}
    # an advantage the objective builds from A (analysis.batch.advantage): w is against it, A its input
    own = find_advantage(original) if own_advantage else None
    situations = scenario_analysis(original, rho, given, check_loss, hat=None if own is None else own[1])
    if scenario is not None:        # the analysis at that scenario's held point, the list as it was
        chosen = find(original, scenario, given)
        if replaced(given, chosen):       # a setting the scenario would replace: refused, never dropped
            raise ValueError(f"objective '{obj.name}': the scenario sets its own held point, and would replace the "
                             f"given {', '.join(replaced(given, chosen))}: drop them, or analyse without --scenario")
        given = at(given, chosen)
        seq_len, point = given.pop("seq_len", seq_len), given
    names = names_of_view(original)
    studied = original if own is None else _with_expr(original, own[0])
    full, scope = analysis_view(studied, seq_len, rho, **point)
    # w is the other terms' where the terms that read π_ref are a channel of their own (k3's β·(q − 1)
    # would make w unbounded and move with |A|, which the policy terms do not)
    rest, _ = reference_split(full.expr, studied.expr, names["rho_ref"])
    obj = full if rest is None else Objective(full.name, full.path, full.source, rest, dict(full.params),
                                              dict(full.options), {}, full.description)
    ctx = Ctx(obj)
    arb = Arbiter(obj, ctx.dl)        # ∂ℓ/∂r derived once, for every numeric check
    facts = grid_facts(arb)
    result = {
        "name": obj.name, "path": obj.path, "description": obj.description, "source": original.source,
        "params": {k: float(v) for k, v in obj.params.items()},
        "options": dict(obj.options),
        "objective": original.canonical().splitlines()[-1],
        "scope": scope,
        "locality": locality_of(original),
    }
    if scope["rho_name"]:
        scope["mismatch_range"] = mismatch_range(obj, scope["rho_name"], ctx.dl)
    tail_facts = tails(arb)
    corners = limits(tail_facts)
    facts["range"] = _closed(facts["range"], corners)
    claims = _derivation(ctx, arb, facts, corners, tail_facts)
    result.update({k: claims[k] for k in ("weight", "cases", "boundary", "geometry")})
    result["advantage"] = None if own is None else _advantage(original, own, names, {**point, "seq_len": seq_len})
    result["entropy"] = entropy_channel(ctx, names["H"], full)
    if result["entropy"] is not None:       # the file's own terms that read H, for the first screen
        result["entropy"]["terms"] = [(s, render(t)) for s, t in terms(original.expr) if _reads_var(t, "H")
                                      and not any(_reads_var(t, v) for v in ("r", "pi", "mu", "pi_ref"))]
    result["reference"] = reference_channel(ctx, names["rho_ref"], studied, full)
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
    result["claims"] = claim_evidence(ctx, arb, result, facts)
    result["warnings"] = (result_alerts(result, claims["exact_range"] if range_held else [False, False],
                                        facts.get("unbounded_by_magnitude", False))
                          + domain_alerts(facts) + on_policy_alerts(result["on_policy"]) + level_alerts(original))
    held_point = _degenerate(result, studied, seq_len, rho, point)
    result["admissibility"] = _qualified(admissibility(ctx, arb, result, tail_facts), held_point)
    result["notes"] = ctx.notes
    result["hang_guard"] = ctx.guard
    result["w"], result["w_numeric"] = claims["w"], arb.w
    result["scenarios"], result["scenario"] = situations, scenario
    res = Analysis(**result)
    if memory:      # each point the same analysis, at the same held point (the loss's check not repeated)
        w_reads = {m.value for m in ctx.dl.walk() if m.op == "param"}
        res.memory = over_memory(original, res, w_reads, lambda o: analyze(o, memory=False, **again))
    return res


def _with_expr(obj: Objective, expr) -> Objective:
    """obj with another expression (Â in A's place), its bindings those still in it."""
    kept = set(expr.walk())
    return Objective(obj.name, obj.path, obj.source, expr, dict(obj.params), dict(obj.options),
                     {k: b for k, b in obj.bindings.items() if b in kept}, obj.description)


def _advantage(original, own, names, point) -> dict:
    """Â's name, its expression, and its value on the held group in the host's A (with where an
    ε alone bounds Â/A), with the report's sentence."""
    _, node, name = own
    values, group = uniform_point(point, names, held_group)
    try:
        held = held_value(original, node, names, values, group)
    except NotHeld as e:    # (a batch quantile of A on spread advantages): refused by name, as the view does
        pos = e.node.pos or Pos(1, 1)
        raise DslError(str(e), original.path, pos.line, pos.col, original.source.split("\n")[pos.line - 1],
                       f"hold the group's advantages equal (--group {','.join(['1'] * len(group))}), or read A "
                       "outside it") from None
    except Exception:       # noqa: BLE001 - SymPy past its depth: Â named, its held value not
        held = None
    at = None
    if held and held["value"] is not None:      # Â for a host's A, as numbers (the tests' gradient checks)
        import sympy as sp
        at = numpy_fn([sp.Symbol("A", real=True, nonzero=True)], held["value"])
    return {"name": name, "expression": render(node), "held": held, "group": [float(c) for c in group], "at": at,
            "reads_group": any(OPS[m.op].over in ("group", "batch") for m in node.walk() if m.op in OPS),
            "text": describe(name, node, held, group)}


def _reads_var(n, name) -> bool:
    return any(m.op == "var" and m.value == name for m in n.walk())


def _degenerate(result, original, seq_len, rho, point) -> str | None:
    """Where w ≡ 0 (or is nowhere finite) for a sign of A but not once the held point is moved
    (_moved), that is the held point's property, not the objective's: said in the held lines
    and its no-gradient warnings replaced by one that says so (a normalized advantage on equal
    responses is 0 by the group, not by ℓ). Where nothing is found there but the held group's
    advantages are equal (held.equal_group), it is unconfirmed, never proven. Returns the status
    every claim then carries ('held point only' or 'unconfirmed'), or None."""
    boundary = result["claims"]["boundary"]
    signs = [adv for adv in ("positive", "negative") if boundary[adv]["claim"] == "w ≡ 0" or result["bounded"] is None]
    if not signs or not result["scope"].get("held"):
        return None
    moved = _moved(original, seq_len, rho, point, result["scope"]["held"])
    found = [adv for adv in signs if moved[adv]]
    group = held_group(point.get("group_size"), point.get("group"))
    equal = equal_group(original, group)
    # w ≡ 0 with the group's r moving together, where a token's own gradient collects the other
    # responses' differing terms (r/group_mean(r)·A at --group 1,0,-0.5: (1 − 1/6)/r, not 0)
    apart = spread(original, group, point.get("group") is not None)
    unsettled = [adv for adv in signs if not moved[adv]] if equal or apart else []
    if not found and not unsettled:
        return None
    where = ", ".join([f"the group's advantages A·({', '.join(f'{float(c):g}' for c in moved['point']['group'])})"]
                      + [f"{display_name(k)} = {float(v):g}" for k, v in moved["point"]["held"].items()])
    for adv in found + unsettled:
        x = moved[adv]
        said = (f"at another held point ({where}) w = {x['w']:.6g} at r = {x['r']:.7g}, μ = {x['mu']:.6g}, "
                f"A = {x['A']:g}: a property of the held point, not of the objective" if x else
                "this w is ∂ℓ/∂r with every response's r moving together; a token's own gradient at this group also "
                "collects the other responses' terms, which differ by their advantages (not derived), and need not "
                "be 0" if apart else
                f"at another held point ({where}) w is 0 or not finite at all the numeric check's {moved['points']:,} grid "
                "points too, but this group's equal advantages make every group statistic of A trivial: whether "
                "that is the objective's or the held point's is not settled")
        boundary[adv] = {**boundary[adv], "status": "held point only" if x else "unconfirmed",
                         "evidence": f"{boundary[adv]['evidence']}; {said}"}
        if not x:       # the warnings say 'unconfirmed' with the evidence under the boundary
            result["warnings"] = [Alert(a.kind, {**a.values, "proven": False}) if a.values.get("adv") == adv
                                  and "proven" in a.values else a for a in result["warnings"]]
            continue
        result["warnings"] = [a for a in result["warnings"] if a.values.get("adv") != adv or a.kind not in (
            "no gradient", "on policy zero", "on policy undefined", "undefined")]
        result["warnings"].append(Alert("degenerate held point", {"adv": adv, "said": said}))
    status = "held point only" if found else "unconfirmed"
    # every other warning but the objective's own (a group reduction by position) is the held point's too
    result["warnings"] = [a if a.kind in ("degenerate held point", "by position") else
                          Alert(a.kind, {**a.values, "held": status}) for a in result["warnings"]]
    for key in ("bounded", "smooth"):
        if key in result["claims"]:
            result["claims"][key] = {**result["claims"][key], "status": status}
    sides = " and ".join({"positive": "A > 0", "negative": "A < 0"}[a] for a in found)
    text = (f"the held point is degenerate for {sides}: "
            f"w is 0 or not finite there because of the held values, not of the objective (with {where}, w ≠ 0); "
            "set another (--group, --set)" if found else
            "the held group's advantages differ and a group or batch reduction passes a gradient: w is 0 or not "
            "finite with every response's r moving together, but a token's own gradient also collects the other "
            "responses' terms (not derived): every claim below is unconfirmed for a token" if apart else
            f"the held group's advantages are equal: w is 0 or not finite here and at another held point ({where}) "
            "on the numeric check's grid, which settles nothing (every group statistic of A is trivial here): every "
            "claim below is unconfirmed; set another (--group)")
    result["scope"]["held"].append({"name": "degenerate", "value": None, "text": text, "moved": {
        "group": [float(c) for c in moved["point"]["group"]],
        "held": {k: float(v) for k, v in moved["point"]["held"].items()}, "found": found}})
    return status


def _moved(original, seq_len, rho, point, held) -> dict:
    """Per sign of A, a point of the arbiter's grid (its thresholds included) where the view at the
    moved held point (analysis.batch.view.moved_view) has a nonzero finite w, as {'r', 'mu', 'A', 'w'},
    or None; with 'point' (the moved point) and 'points' (the grid's size)."""
    import numpy as np
    view, moved = moved_view(original, seq_len, rho, point, held)
    arb = Arbiter(view, derivative(view.expr))
    out = {"point": moved, "points": int(arb.inside.sum())}
    for adv, sign in SIGNS:
        ok = arb.valid & (arb.W != 0) & (arb.sign == sign)
        ok[ok] = _reproduced(arb, ok)
        # the one nearest r = 1, μ = 1 and |A| = 1 (the domain's corners are what a reader expects least)
        far = np.abs(np.log(np.where(ok, arb.R, 1.0))) + np.abs(np.log(arb.mu)) + np.abs(np.log(arb.mag))
        far = np.where(ok, far, np.inf)
        i, j = np.unravel_index(np.argmin(far), far.shape) if ok.any() else (None, None)
        out[adv] = None if i is None else {"r": float(arb.R[i, j]), "mu": float(arb.mu[i, 0]),
                                           "A": float(arb.sign[i, 0] * arb.mag[i, 0]), "w": float(arb.W[i, j])}
    return out


def _reproduced(arb, ok):
    """Of the grid's nonzero w at `ok`, those extended precision (numpy's long double, 11 more
    bits) gives again to half a double's digits: a weight does, the doubles' rounding of a zero does
    not (r/group_mean(r) − 1 is 2.2e-16 in doubles, 0 or 1e-19 in long double). Where the platform's
    long double is a double, every one stands, as the doubles say."""
    np = arb.np
    if np.finfo(np.longdouble).eps >= np.finfo(float).eps:
        return np.ones(int(ok.sum()), dtype=bool)
    mu, A = (np.broadcast_to(x, ok.shape)[ok] for x in (arb.mu, arb.sign * arb.mag))
    with np.errstate(all="ignore"):
        wide = np.asarray(arb.w(arb.R[ok].astype(np.longdouble), mu, A, dtype=np.longdouble), dtype=float)
        return np.isfinite(wide) & (np.abs(wide - arb.W[ok]) <= np.sqrt(np.finfo(float).eps) * np.abs(arb.W[ok]))


def _qualified(adm: dict, status: str | None) -> dict:
    """At a degenerate held point every admissibility property carries its status, the method it
    rests on kept as 'basis' (a property found at the held point only is not the objective's)."""
    if status is None:
        return adm
    return {**adm, **{k: {**adm[k], "status": status, "basis": adm[k]["status"]}
                      for k in ("w_at_1", "bounded", "tails", "symmetric_log_r")}}


def _derivation(ctx, arb, facts, corners, tail_facts) -> dict:
    """The derivation's claims, or, where SymPy is not tried (past a budget) or gives out, the
    numeric arbiter's alone, with a note that says why."""
    claims, why = None, None
    if (size := tree_size(ctx.dl)) > SYMBOLIC_SIZE:
        why = f"∂ℓ/∂r has {size:,} operations written out; SymPy is tried up to {SYMBOLIC_SIZE:,}"
    elif (power := highest_power(ctx.dl)) > SYMBOLIC_POWER:
        why = f"∂ℓ/∂r has the power ^{power:g}; SymPy is tried up to ^{SYMBOLIC_POWER}"
    elif (n := branches(ctx.dl)) > BUDGET["branches"]:
        why = f"∂ℓ/∂r has {n} branch points (min, max, clip, masks, comparisons); SymPy is tried up to {BUDGET['branches']}"
    else:
        try:
            with time_limit(budgets.HANG_SECONDS):
                claims = _derived(ctx, arb, facts, corners, tail_facts)
        except Timeout:
            ctx.hang("the derivation")
            why = f"the hang guard fired at {budgets.HANG_SECONDS:g} s of CPU time"
        except RecursionError:
            why = "the expression is too deeply nested for SymPy"
        except Unsettled as e:
            why = f"settling one case's conditions took {e}"
    if why:
        ctx.notes.append(f"the weight is not derived symbolically ({why}): every finding below is the "
                         "numeric check's")
    if claims is None:
        boundary, notes = confirm_boundaries(ctx, arb, facts, {adv: [] for adv, _ in SIGNS})
        claims = {"weight": None, "cases": [], "boundary": boundary, "range": facts["range"],
                  "exact_range": [False, False], "w": arb.w,
                  "geometry": numeric_geometry(arb, boundary), "weight_check": {"status": "not derived"}}
        ctx.notes += notes
    return claims


def _closed(rng, corners):
    """The range with the limits the tails show at the domain's corners (0 where w decays)."""
    if rng is None:
        return rng
    lo, hi = rng
    for v in corners:
        lo = None if lo is None else min(lo, v)
        hi = None if hi is None else max(hi, v)
    return [lo, hi]


def _widen(facts, on_policy_facts):
    """r = 1 is not on the arbiter's grid (it has its own check): its w belongs in the range."""
    rng = facts["range"]
    for f in on_policy_facts.values():
        lo, hi = f["w"]
        if rng is not None and lo is not None:
            rng[0] = None if rng[0] is None else min(rng[0], lo)
            rng[1] = None if rng[1] is None else max(rng[1], hi)


def _derived(ctx, arb, facts, corners, tail_facts) -> dict:
    """The derivation's claims, each boundary already confirmed or dropped by the arbiter."""
    cases, candidates, entangled = derive(ctx)
    w = case_dispatch(ctx, cases)
    checks = [check_weight(arb, w)]
    settle_zero_weight(ctx, arb, facts, tail_facts, cases, checks[0])
    boundary, notes = confirm_boundaries(ctx, arb, facts, candidates)
    ctx.notes += notes
    num = Numeric(ctx, w, cases, entangled)
    sampled, exact = num.weight_range(corners)
    weight = full_weight(ctx, cases)
    # the one-line w is printed too: checked like the cases (for a smooth objective it is
    # derived on its own, with the parameters symbolic)
    values = {ctx.param_syms[k]: v for k, v in ctx.param_vals.items()}
    try:
        whole = numpy_fn([ctx.r, ctx.mu, ctx.A], weight.subs(values))
        checks.append(check_weight(arb, whole))
    except NotImplementedError:     # a function numpy lacks (LambertW): the cases' check stands
        pass
    worst = next((c for c in checks if c["status"] == "disagrees"), checks[0])
    # "the weight depends on |A|" is a claim that something exists: it rests on the arbiter
    # finding w differ between magnitudes of A, not on a formula that names |A| (2^log|A|/|A|^log 2 is 1)
    found = entangled and len(arb.magnitudes) > 1
    return {"weight": weight, "cases": cases, "boundary": boundary, "range": sampled,
            "exact_range": exact, "w": w, "geometry": geometry(ctx, cases, boundary, found),
            "weight_check": worst}
