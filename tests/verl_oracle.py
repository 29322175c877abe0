"""Run by tests/test_verl.py with the verl venv's python (verl cannot share the main environment):
each shipped objective that mirrors a verl policy loss, through verl's own get_policy_loss_fn
(and so its agg_loss), against ours registered by openrlhf_drpo.verl, in loss and gradient, in
every loss_agg_mode, with and without verl's global batch info and rollout IS weights. Prints one
JSON line per comparison; exits 1 if any differs."""
import dataclasses
import itertools
import json
import os
import sys

import torch

os.environ.setdefault("VERL_USE_EXTERNAL_MODULES", "openrlhf_drpo.verl")   # verl's own plugin hook
import verl  # noqa: E402,F401  (imports openrlhf_drpo.verl through the variable above)
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

# verl's own hook registered ours, before anything here imports the adapter
HOOKED = "dsl:drpo" in POLICY_LOSS_REGISTRY
import openrlhf_drpo.verl as adapter  # noqa: E402
import dsl  # noqa: E402
from dsl import parse  # noqa: E402
from dsl.objective import OPTIONS  # noqa: E402

MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# (ours, its parameters at verl's values, verl's loss_mode, verl's config, modes verl honours)
CASES = [
    ("ppo_dual_clip", dict(ε_low=0.2, ε_high=0.28, c=3), "vanilla",
     dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0), MODES),
    # without dual clip: verl's vanilla with clip_ratio_c past every |ratio| here
    ("grpo_clip_higher", {}, "vanilla", dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1e9), MODES),
    ("ppo", {}, "vanilla", dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=1e9), MODES),
    ("gspo", dict(ε_low=0.2, ε_high=0.28), "gspo", dict(clip_ratio_low=0.2, clip_ratio_high=0.28), MODES),
    ("dppo_binary_tv", dict(δ=0.2), "dppo_tv", dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=20.0), MODES),
    ("dppo_binary_kl", dict(δ=0.05), "dppo_kl", dict(clip_ratio=0.05, clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=20.0), MODES),
    # ours clips r above only; verl's lower bound 1 - 1 = 0 is no bound on r > 0
    ("cispo", dict(ε_high=0.28), "cispo", dict(clip_ratio_low=1.0, clip_ratio_high=0.28), MODES),
    ("sapo", dict(τ_pos=1.0, τ_neg=1.05), "sapo", dict(tau_pos=1.0, tau_neg=1.05), ["seq-mean-token-mean"]),
    ("gpg", {}, "gpg", {}, MODES),
    ("dro", dict(τ=0.05), "dro", dict(policy_loss=dict(dro_beta=0.05)), MODES),
    ("gmpo", dict(ε=0.4), "geo_mean", dict(clip_ratio=0.4, clip_ratio_low=0.4, clip_ratio_high=0.4), ["seq-mean-token-mean"]),
]
# verl's DPPO losses are the surrogate -A·sg(min(r, clip_ratio_c))·log π: the gradient of ours
# (r·A) up to the truncation, but not its value; the same formula written in our language is held
# to the value too. (verl reads clip_ratio_c from the actor config, whose default is 3.0, not the
# 20 its code falls back to; the cases above set 20, past every ratio here.)
VERL_FORM = {
    "dppo_tv": "δ = 0.2\nD = |π - μ|\n[A*(r - 1) <= 0 or D <= δ]*sg(min(r, 20))*A*log(π)\n",
    "dppo_kl": "δ = 0.05\nD = μ*log(μ/π) + (1 - μ)*log((1 - μ)/(1 - π))\n"
               "[A*(r - 1) <= 0 or D <= δ]*sg(min(r, 20))*A*log(π)\n",
    # GSPO-token: each token's gradient is s·∇log π_t (its own IS weight), where ours spreads
    # d s/d log π_t = s/|y| over the response; equal without per-token weights
    "gspo": "ε_low = 0.2\nε_high = 0.28\ns = exp(min(sg(seq_mean(log(π) - log(μ))) + log(π) - sg(log(π)), 10))\n"
            "min(s*A, clip(s, 1 - ε_low, 1 + ε_high)*A)\n",
}
# where verl's rollout IS weights act otherwise than per token (ours): the shipped objective must
# differ there, and the test says so rather than skip it
IS_WEIGHTS_DIFFER = {
    "gspo": "verl's GSPO-token gradient weights each token by its own IS weight",
    "geo_mean": "verl's geo_mean takes the geometric mean of a response's IS weights",
}


def batch(seed, B=12, T=9):
    """Responses of lengths 0..T moved as a whole (log r from -0.6 to 1.3, so every clip acts:
    below 1 - ε, above 1 + ε and past dual clip's c = 3), with both signs of A at each shift."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05
    shift = torch.linspace(-0.6, 1.3, B // 2, dtype=torch.float64).repeat_interleave(2)[:, None]
    logp = (mu.log() + shift + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    sign = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(B // 2)[:, None]
    A = (sign * (0.2 + torch.rand(B, 1, generator=g, dtype=torch.float64))).expand(B, T).clone()  # one per response
    A[0] = 0.0
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[3] = 0
    mask = torch.arange(T) < lengths[:, None]
    weights = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    return mu.log(), logp, A, mask, weights


def config(loss_mode, overrides, info):
    over = dict(overrides)
    pl = over.pop("policy_loss", {})
    cfg = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                      policy_loss=PolicyLossConfig(loss_mode=loss_mode, **pl), **over)
    cfg.global_batch_info.update(info)
    return cfg


def run(name, old, logp, A, mask, mode, cfg, weights):
    lp = logp.clone().requires_grad_()
    loss, metrics = get_policy_loss_fn(name)(old_log_prob=old, log_prob=lp, advantages=A, response_mask=mask,
                                             loss_agg_mode=mode, config=cfg, rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def declaring(ours, params, mode, fused, cache={}):      # noqa: B006 (one registration per key)
    """ours at params, registered with its @aggregate as verl's loss_agg_mode where it declares one (verl
    refuses one it would replace); under token-sum, which the language has no name for, the same formula
    without the declaration."""
    obj = dsl.load(ours)
    declared = "aggregate" in obj.declared
    key = (ours, fused, mode if declared else None)
    if key not in cache:
        if declared:
            obj = (obj.with_overrides({}, {"aggregate": mode}) if mode in OPTIONS["aggregate"] else
                   dataclasses.replace(obj, declared=frozenset()))
        cache[key] = adapter.register(obj, name=":".join([ours, str(fused), *key[2:3] * declared]), fused=fused,
                                      **params)
    return cache[key]


def main():
    failures, rows = 0, 0
    infos = {"local": {}, "global": dict(dp_size=2, batch_num_tokens=97, global_batch_size=21, loss_scale_factor=16)}
    # verl's geo_mean ignores both: a plain mean over all responses, the empty one too
    geo_infos = {"all responses": dict(global_batch_size=12)}
    for (ours, params, theirs, over, modes), fused, seed in itertools.product(CASES, (True, False), (0, 1)):
        old, logp, A, mask, w = batch(seed)
        for mode, (info_name, info), weights in itertools.product(modes, (geo_infos if theirs == 'geo_mean' else infos).items(), (None, w)):
            mine = declaring(ours, params, mode, fused)
            forms = [(mine, True)]
            if theirs in VERL_FORM:
                text = adapter.register(parse(VERL_FORM[theirs], f"<verl {theirs}>"), name=f"verl_{theirs}:{fused}",
                                        fused=fused)
                # the shipped one: the value where it is the same form; verl's form: both
                forms = [(mine, theirs not in ("dppo_tv", "dppo_kl")), (text, True)]
            cfg = config(theirs, over, info)
            l_ref, g_ref, _ = run(theirs, old, logp, A, mask, mode, cfg, weights)
            for name, check_value in forms:
                # ours with the config a user writes for it: verl's clip settings at their defaults
                # (the objective's parameters replace them; a config setting them is refused)
                l, g, metrics = run(name, old, logp, A, mask, mode, config(name, {}, info), weights)
                same_grad = torch.allclose(g, g_ref, rtol=1e-12, atol=0)
                same_loss = torch.allclose(l, l_ref, rtol=1e-12, atol=0) if check_value else None
                ok = same_grad and same_loss is not False and "actor/drpo_w_mean" in metrics
                expected_difference = None
                if name == mine and weights is not None and theirs in IS_WEIGHTS_DIFFER:
                    expected_difference = IS_WEIGHTS_DIFFER[theirs]
                    ok = not same_grad
                failures += not ok
                rows += 1
                print(json.dumps(dict(ours=name, verl=theirs, mode=mode, info=info_name, is_weights=weights is not None,
                                      seed=seed, expected_difference=expected_difference, loss=l.item(), verl_loss=l_ref.item(), same_loss=same_loss,
                                      max_grad_diff=(g - g_ref).abs().max().item(), same_grad=same_grad, ok=ok)))
    # a control: another ε differs, so the comparisons above can fail
    old, logp, A, mask, w = batch(0)
    control = adapter.register("ppo_dual_clip", name="control", ε_low=0.2, ε_high=0.1, c=3)
    cfg = config("vanilla", CASES[0][3], {})
    control_differs = not torch.allclose(run(control, old, logp, A, mask, "token-mean", config(control, {}, {}), None)[1],
                                         run("vanilla", old, logp, A, mask, "token-mean", cfg, None)[1], rtol=1e-12, atol=0)
    # a bad objective stops at registration with its located error
    from dsl import DslError
    try:
        adapter.register(parse("δ = 1\nr*A - x\n", "bad.dsl"))
        located = None
    except DslError as e:
        located = e.render().splitlines()[0]
    # an objective and its parameters in verl's config alone: loss_mode carries them (a Hydra
    # override, quoted), resolved at verl's first lookup, and equal to the same registered by hand
    from hydra.core.override_parser.overrides_parser import OverridesParser
    override = OverridesParser.create().parse_override('actor_rollout_ref.actor.policy_loss.loss_mode="dsl:drpo?delta=0.3"')
    by_config, by_hand = override.value(), adapter.register("drpo", name="drpo_by_hand", delta=0.3)
    cfg = config(by_config, {}, {})
    via_config = [run(mode, old, logp, A, mask, "token-mean", cfg, None) for mode in (by_config, by_hand)]
    default = run("dsl:drpo", old, logp, A, mask, "token-mean", cfg, None)
    config_params = (torch.equal(via_config[0][1], via_config[1][1]) and not torch.equal(via_config[0][1], default[1]))
    try:
        get_policy_loss_fn("dsl:drpo?delta")
        malformed = None
    except Exception as e:      # noqa: BLE001 (the test pins its type and message)
        malformed = f"{type(e).__name__}: {e}"
    # refused where verl would otherwise fail later or silently: an objective on the rollout
    # policy (verl passes none), an aggregation parameter (loss_agg_mode is verl's), a local
    # count with several data-parallel ranks (as agg_loss), a setting of verl's own policy losses
    refusals = {}
    for what, call in [("rollout", lambda: adapter.register("icepop")),
                       ("rollout_by_config", lambda: get_policy_loss_fn("dsl:tis_ppo")),
                       ("aggregate", lambda: adapter.register("ppo", aggregate="seq-mean-token-mean")),
                       # an objective's @aggregate that verl's loss_agg_mode would replace
                       ("declared_aggregate", lambda: run("dsl:gspo", old, logp, A, mask, "token-mean",
                                                          config("dsl:gspo", {}, {}), None)),
                       ("dp_size", lambda: run("dsl:ppo", old, logp, A, mask, "token-mean", config("vanilla", {}, dict(dp_size=2)), None)),
                       # verl's own policy losses' settings, which the objective replaces
                       ("clip_ratio_high", lambda: run("dsl:ppo", old, logp, A, mask, "token-mean",
                                                       config("dsl:ppo", dict(clip_ratio_high=0.28), {}), None)),
                       ("clip_ratio_c_and_dro_beta", lambda: run("dsl:drpo", old, logp, A, mask, "token-mean", config(
                           "dsl:drpo", dict(clip_ratio_c=10.0, policy_loss=dict(dro_beta=0.05)), {}), None))]:
        try:
            call()
            refusals[what] = None
        except Exception as e:      # noqa: BLE001 (the test pins each one's type and message)
            refusals[what] = f"{type(e).__name__}: {e}"
    # each loss_mode a refusal names as the objective's equivalent is one verl's lookup resolves
    import re
    named = [m for _, text in adapter.SUPERSEDED.values() for m in re.findall(r"loss_mode=(dsl:\S+)", text.format(1.5))]
    unresolved = []
    for loss_mode in named:
        try:
            get_policy_loss_fn(loss_mode)
        except Exception as e:      # noqa: BLE001 (reported by name)
            unresolved.append(f"{loss_mode}: {e}")
    # a path alone (no parameters) is resolved from loss_mode too
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "objectives", "spo.dsl")
    by_path = torch.equal(run(f"dsl:{path}", old, logp, A, mask, "token-mean", cfg, None)[1],
                          run("dsl:spo", old, logp, A, mask, "token-mean", cfg, None)[1])
    import importlib.util
    checks = dict(hooked=HOOKED, control_differs=control_differs, config_params=config_params, by_path=by_path,
                  located_error=located == "bad.dsl:2:7: error: unknown name 'x'",
                  equivalents_resolve=len(named) == 7 and not unresolved,
                  no_openrlhf=importlib.util.find_spec("openrlhf") is None)
    failures += not all(checks.values())
    shipped = [n for n in POLICY_LOSS_REGISTRY if n.startswith("dsl:") and not any(c in n[4:] for c in "@:?")]
    print(json.dumps(dict(summary=True, rows=rows, failures=failures, located=located, refusals=refusals,
                          malformed=malformed, unresolved=unresolved, **checks,
                          registered=sorted(shipped))))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
