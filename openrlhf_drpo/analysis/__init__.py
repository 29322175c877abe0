"""drpo-analyze's engine: what an objective does to each token's gradient, derived with SymPy
(context, symbolic, settling, intervals, zeros), confirmed by a numeric arbiter (arbiter, events,
extremes, sampling, confirm) and stated as claims with their evidence (claims, admissibility,
alerts), held in one declared result (result) that the presentation renders (report, plot,
alert_text, mathtext, notebook). `analyze` is the public entry point; budgets bounds the work."""
from __future__ import annotations

from collections.abc import Iterable

import dsl
from openrlhf_drpo.analysis.present import notebook  # noqa: F401  (registers how a result renders)
from openrlhf_drpo.analysis.batch.held import GROUP_SIZE
from openrlhf_drpo.analysis.orchestrator import analyze as _analyze
from openrlhf_drpo.analysis.result import Analysis


def analyze(objective: str | dsl.Objective, *, seq_len: int = 1, rho: float = 1.0, group_size: int = GROUP_SIZE,
            group: Iterable[float] | None = None, batch_size: int | None = None, position: int | None = None, held: dict | None = None,
            scenario: str | None = None, check_loss: bool = False, own_advantage: bool = True, **params) -> Analysis:
    """What drpo-analyze prints, as a value: `objective` is a shipped name, a .dsl path, NAME:k=v,...
    or a dsl.Objective (dsl.parse("r*A - ...") for a formula); keyword `params` override its
    parameters (ASCII or Unicode names). The others are drpo-analyze's --seq-len, --rho,
    --group-size, --group, --batch-size, --position and the held values (--set H=...); `scenario`
    analyses one of its scenarios (--scenario NAME; the result's `scenarios` lists them), and
    `check_loss` holds each scenario's claim to the compiled loss (--check-loss; imports torch);
    `own_advantage=False` takes w against the host's A where the file builds its own Â."""
    if not isinstance(objective, dsl.Objective):
        name, own = dsl.parse_spec(objective)
        objective = dsl.load(name).with_overrides(own, where="<command line>") if own else dsl.load(name)
    if params:
        objective = objective.with_overrides(params, where="analyze")
    if group is not None:
        from openrlhf_drpo.analysis.batch.held import held_group
        group = held_group(None, list(group))
        group_size = len(group)
    from fractions import Fraction

    from dsl.objective import param_key
    held = {param_key(k): Fraction(str(v)) for k, v in (held or {}).items()}
    return _analyze(objective, seq_len, rho, group_size=group_size, batch_size=batch_size, position=position,
                    group=group, held=held, scenario=scenario, check_loss=check_loss,
                    own_advantage=own_advantage)


def equivalent(a: str | dsl.Objective, b: str | dsl.Objective, *, seq_len: int = 1, rho: float = 1.0,
               group: Iterable[float] | None = None) -> dict:
    """drpo-analyze --equiv A B as a value (its --json): the verdict over the analysed point, `group`
    (--group) where given, and every scenario of either objective, with each one's witness."""
    from openrlhf_drpo.analysis.equiv import equivalence
    from openrlhf_drpo.analysis.batch.held import held_group
    a, b = (o if isinstance(o, dsl.Objective) else dsl.load(o) for o in (a, b))
    return equivalence(a, b, seq_len, rho, group=None if group is None else held_group(None, list(group)))


__all__ = ["Analysis", "analyze", "equivalent"]
