"""The objective the analysis studies, and what it stands for: a token-level objective in r,
μ and A. A sequence objective is studied on a response whose tokens share r, μ and A; one
that names the policy μ is not is studied at a held train/rollout ratio ρ, over which its
on-policy weight is also sampled."""
from __future__ import annotations

from fractions import Fraction

from openrlhf_drpo.analysis.batch.held import (GROUP_SIZE, HELD, OnPolicy, exactness, held_group, holdable, spread,
                                         statements, statistics)
from dsl.errors import DslError
from dsl.ir import Node, Pos, add, is_num, neg, rebuild, sub
from dsl.names import display_name
from dsl.objective import Objective
from dsl.walks import VIEW_NAMES, NotHeld, derivative, numpy_plan, reads_whole_response, uniform_view


def analysis_view(obj: Objective, seq_len=1, rho=1, *, group_size=None, batch_size=None, position=None,
                  held=None, group=None, said=True) -> tuple[Objective, dict]:
    """The token-level objective in r, μ and A that is analysed, and what it stands for. A
    sequence objective is studied on a response whose tokens share r, μ and A (|y| = seq_len
    tokens): each reduction is its value there, r is the response's ratio, and every token's
    gradient is exactly the w·r·A derived for it. The policy μ is not is μ·ρ or μ/ρ, with ρ =
    π_old/π_rollout held at `rho`. The third version's reductions are studied on a uniform batch
    of `batch_size` responses (default: one group) in groups of `group_size`, at `position` (default
    the last token); π_ref, H and each statistic a binding names (analysis.batch.held) are held at
    `held`'s values or their defaults. `group`: the group's advantages as multiples of the token's
    A, its response first (analysis.batch.held.held_group; default: binary rewards with a spread, half
    the group scoring A, half 0), which sets G. Existing token-level objectives are unchanged.
    said=False: the view alone, without the held lines' words (an indicator's view per scenario)."""
    explicit, group = group is not None, held_group(group_size, group)
    group_size = len(group)
    batch_size = group_size if batch_size is None else batch_size
    position = seq_len if position is None else position
    _check_point(seq_len, group_size, batch_size, position)
    names = obj.names()
    sequence = any(map(reads_whole_response, obj.expr.walk()))
    other = {"old": "pi_rollout", "rollout": "pi_old"}[obj.options["anchor"]]
    scope = {"sequence": sequence, "seq_len": seq_len if sequence else None,
             "mismatch": other in names, "rho": rho if other in names else None, "rho_name": None, "held": []}
    if not sequence and not names & {"pi_old", "pi_rollout", *V3_INPUTS}:
        if held:
            _check_held(obj, held, set())
        return obj, scope
    view_names = names_of_view(obj)
    point = {"seq_len": seq_len, "position": position, "group_size": group_size, "batch_size": batch_size}
    values = {view_names[k]: Fraction(v) for k, v in point.items()}
    stats = statistics(obj, obj.options["anchor"], view_names, values, group)
    _check_held(obj, held or {}, holdable(obj, stats))
    chosen = {**HELD, **{k: v for k, (_, v) in stats.items()}, **{k: Fraction(v) for k, v in (held or {}).items()}}
    values |= {view_names["rho"]: Fraction(rho), view_names["rho_ref"]: chosen["rho_ref"], view_names["H"]: chosen["H"],
               view_names["staleness"]: chosen["staleness"],
               **{k: chosen[k] for k in stats}}
    swap = {node: Node("param", value=k) for k, (node, _) in stats.items()}     # each held statistic as its parameter
    expr = rebuild(obj.expr, lambda m, args: swap.get(m))
    try:
        expr = uniform_view(expr, obj.options["anchor"], view_names, group, None if swap else obj.facts.level)
    except NotHeld as e:        # (a batch quantile of A: its neighbours' ranks depend on N and on A's sign)
        pos = e.node.pos or Pos(1, 1)
        raise DslError(str(e), obj.path, pos.line, pos.col, obj.source.split("\n")[pos.line - 1],
                       f"hold the group's advantages equal (--group {','.join(['1'] * len(group))}), or read A "
                       "outside it") from None
    used = {n.value for n in expr.walk() if n.op == "param"}
    params = dict(obj.params) | {k: v for k, v in values.items() if k in used and k not in obj.params}
    scope["rho_name"] = view_names["rho"] if view_names["rho"] in used else None
    scope["held"] = statements(obj, point, stats, chosen, group, explicit) if said else []
    if scope["held"]:
        moved = [k for k, (_, v) in stats.items() if chosen[k] != v or isinstance(v, OnPolicy)]
        weighed = reference_split(expr, obj.expr, view_names["rho_ref"])[0] or expr      # what w is derived from
        scope["exact"] = exactness(obj, locality_of(obj), moved, _in_weight(weighed, scope["held"], view_names),
                                   spread(obj, group, explicit))
    view = Objective(obj.name, obj.path, obj.source, expr, params, dict(obj.options), {}, obj.description)
    return view, scope


def terms(n: Node, sign: int = 1) -> list:
    """The top-level sum's terms, each (±1, node)."""
    if n.op == "add":
        return terms(n.args[0], sign) + terms(n.args[1], sign)
    if n.op == "sub":
        return terms(n.args[0], sign) + terms(n.args[1], -sign)
    if n.op == "neg":
        return terms(n.args[0], -sign)
    return [(sign, n)]


def term_sum(parts) -> Node:
    out = None
    for s, t in parts:
        out = (t if s > 0 else neg(t)) if out is None else add(out, t) if s > 0 else sub(out, t)
    return out


def _reads(n: Node, param: str) -> bool:
    return any(m.op == "param" and m.value == param for m in n.walk())


def reference_split(view: Node, original: Node, ref_name: str) -> tuple[Node | None, list]:
    """(the rest, the reference terms): the terms of the view's top-level sum that read π_ref
    (the parameter ref_name), each paired (view, file) with the file's own term, and the sum of
    the others where those are a channel of their own: each a whole term of the file's sum too,
    and the rest has a derivative in r (w is then the rest's, and ∂ℓ_ref/∂log π is reported
    beside it, never read by w's warnings). The rest is None where they are not separable
    (r·A·(π_ref/π)^β: the whole ℓ is the reference term, and w reads it)."""
    pairs = list(zip(terms(view), terms(original)))
    if len(terms(view)) != len(pairs) or len(terms(original)) != len(pairs):
        # the view changed the sum's shape (group_mean(a + b) is a + b there): the whole objective
        return None, [((1, view), (1, original))]
    chosen = [(v, o) for v, o in pairs if _reads(v[1], ref_name)]
    if not chosen:
        return None, []
    others = [v for v, _ in pairs if not _reads(v[1], ref_name)]
    rest = term_sum(others) if others else None
    try:
        return (None if rest is None or is_num(derivative(rest), 0) else rest), chosen
    except ValueError:      # NonLocal (a ValueError): a reduction of the policy left in it
        return None, chosen


def _in_weight(expr: Node, held: list, view_names: dict) -> list[str]:
    """The held values ∂ℓ/∂r reads, as 'name = value' (w, its cases and boundaries are numbers
    there, not functions of them)."""
    param = {"G": "group_size", "N": "batch_size", "p": "position", "rho_ref": "rho_ref", "H": "H",
             "staleness": "staleness"}
    read = {n.value for n in derivative(expr).walk() if n.op == "param"}
    return [f"{display_name(h['name'])} = {float(h['value']):.12g}" for h in held
            if h["value"] is not None and view_names.get(param.get(h["name"]), h["name"]) in read]


def _check_point(seq_len, group_size, batch_size, position):
    for name, v in (("seq_len", seq_len), ("group_size", group_size), ("batch_size", batch_size),
                    ("position", position)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if batch_size % group_size:
        raise ValueError(f"batch_size {batch_size} is not a multiple of group_size {group_size}: a uniform batch "
                         "holds whole groups")
    if position > seq_len:
        raise ValueError(f"position {position} is past the response's last token (seq_len {seq_len})")


def _check_held(obj, held: dict, allowed: set):
    for name, value in held.items():
        if name not in allowed:
            can = ", ".join(sorted(allowed)) or "none"
            raise ValueError(f"objective '{obj.name}' holds no value named '{name}' (it holds: {can})")
        if why := held_value_error(name, value):
            raise ValueError(f"{name} = {value}: {why}")


def names_of_view(obj: Objective) -> dict:
    """The parameters uniform_view writes for obj (VIEW_NAMES; one the file already uses is renamed)."""
    taken = set(obj.params) | set(obj.bindings)
    names = {k: v if v not in taken else v + "_held" for k, v in VIEW_NAMES.items()}
    names["rho"] = "rho" if "rho" not in obj.params else "rho_mismatch"
    return names


def held_names(obj: Objective) -> set[str]:
    """The values obj's analysis holds that --set may give (H, rho_ref, a statistic's binding name)."""
    names = names_of_view(obj)
    point = {names[k]: Fraction(1) for k in ("seq_len", "position", "group_size", "batch_size")}
    point[names["group_size"]] = point[names["batch_size"]] = Fraction(GROUP_SIZE)
    return holdable(obj, statistics(obj, obj.options["anchor"], names, point, held_group(GROUP_SIZE, None)))


def held_value_error(name: str, value) -> str | None:
    """Why a held value is not one the analysis can hold (an entropy is ≥ 0, a ratio of
    probabilities > 0), or None."""
    if name == "H" and value < 0:
        return "an entropy is at least 0"
    if name == "rho_ref" and value <= 0:
        return "ρ_ref = π_ref/μ is a ratio of probabilities, above 0"
    if name == "staleness" and value < 0:
        return "staleness counts policy versions, at least 0"
    return None


def locality_of(obj: Objective) -> dict:
    """Which tokens' gradients depend on which (dsl.levels): `width`, the widest reduction a value
    of the current policy passes through, under sg too (token, response, group or batch);
    `gradient`, the widest one a gradient passes through (narrower where the wide one reads the
    policy under sg only); `kept_whole`, what one loss call must hold whole for the compiled
    loss to be exact (groups, the batch: statistics of fixed inputs too)."""
    return {"width": obj.facts.locality, "gradient": obj.facts.gradient_width, "kept_whole": list(obj.facts.kept_whole)}


V3_INPUTS = ("pi_ref", "H", "sum_pi_sq", "staleness")


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
    # each sign's w to the grid's shape first: a w that is one number (ℓ linear in r) is a scalar
    w = np.stack([np.broadcast_to(x, (mu.shape[0], rho.size)) for x in ws])
    finite = w[np.isfinite(w)]
    kept = rho[np.any(np.isfinite(w) & (w != 0), axis=(0, 1))]
    return {"w": [float(finite.min()), float(finite.max())] if finite.size else [None, None],
            "kept": [float(kept.min()), float(kept.max())] if kept.size else None,
            "grid": list(MISMATCH_GRID), "status": "numeric"}


# the held group and values the degeneracy check moves to: a group with a spread of both signs,
# each held value moved off its own (an entropy stays ≥ 0 and a ratio > 0)
OTHER_GROUP = (1, 0, Fraction(-1, 2), 2)


def other_point(obj: Objective, seq_len, rho, point: dict, held: list) -> dict:
    """The held point moved: the group to OTHER_GROUP's pattern (G ≥ 2), each held value v (H,
    ρ_ref, a statistic) to 3v/2 + 1/4: {'group': ..., 'held': {name: value}} for analysis_view."""
    own = len(point["group"]) if point.get("group") else point.get("group_size") or GROUP_SIZE
    G = max(own, 2)
    group = tuple((OTHER_GROUP * G)[:G])
    names = held_names(obj)
    values = {h["name"]: Fraction(h["value"]) * Fraction(3, 2) + Fraction(1, 4) for h in held
              if h["name"] in names and h["value"] is not None}
    batch = point.get("batch_size")
    return {"group": group, "held": values, "position": point.get("position"),
            "batch_size": None if batch is None else G * max(batch // own, 1)}


def moved_view(obj: Objective, seq_len, rho, point: dict, held: list) -> tuple[Objective, dict]:
    """The analysis view at the held point moved (other_point), and that point: where the analysis
    finds w ≡ 0 (or nowhere finite) and the moved view does not (the orchestrator searches it on
    the arbiter's grid, thresholds included), the held point is degenerate, and the finding is a
    property of it, not of the objective."""
    moved = other_point(obj, seq_len, rho, point, held)
    return analysis_view(obj, seq_len, rho, **moved)[0], moved
