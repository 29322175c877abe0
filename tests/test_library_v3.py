"""The library's third-version objectives, each held to an independent torch implementation of its
source's formula, written here from the authors' or the host's code (research notes, v3), never from
this project's IR: loss and gradient (to log π, and to H where read) in float64, on both paths and the
sync-free kernels, on a batch with an empty response, responses of unequal lengths, groups of one
and masked slots holding NaN and ±inf (the references get clean inputs, as the sources multiply by
the mask); and each clip, cap and baseline acts on that batch."""
import math

import pytest
import torch

import dsl
from openrlhf_drpo.core import CompiledLoss

F64 = torch.float64
LENGTHS = [0, 12, 9, 1, 11, 7, 4, 12, 6, 10]
GROUPS = [0, 0, 0, 1, 1, 1, 2, 3, 3, 4]       # {empty, 12, 9}, {1, 11, 7}, {4} alone, {12, 6}, {10} alone


def batch(seed, T=12):
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 2.5 - 0.05
    new = old + 0.15 * torch.randn(B, T, generator=g, dtype=F64)
    pi_old = torch.exp(old)
    A = torch.randn(B, 1, generator=g, dtype=F64) + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    new[4, 2], A[4, 2] = old[4, 2] + 1.5, -5.0          # a ratio past the dual clip's 3, against a negative advantage
    return dict(new=new, old=old, A=A, rollout=old + 0.2 * torch.randn(B, T, generator=g, dtype=F64),
                ref=old + 0.5 * torch.randn(B, T, generator=g, dtype=F64), H=torch.rand(B, T, generator=g, dtype=F64) * 3,
                spq=pi_old ** 2 + torch.rand(B, T, generator=g, dtype=F64) * (1 - pi_old) ** 2,
                mask=torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None], groups=torch.tensor(GROUPS))


def dirty(x, mask):
    junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype).repeat(x.numel() // 3 + 1)
    return torch.where(mask, x, junk[: x.numel()].view_as(x))


def token_mean(loss, m):
    return (loss * m).sum() / m.sum()


def seq_mean_token_mean(loss, m):
    """The language's seq-mean-token-mean, OpenRLHF's aggregate_loss: each response's token sum over
    its count + 1e-8, averaged over the non-empty responses."""
    n = m.sum(-1)
    return ((loss * m).sum(-1) / (n + 1e-8))[n > 0].mean()


def ppo(r, A, low=0.2, high=0.2):
    return torch.min(r * A, r.clamp(1 - low, 1 + high) * A)


def host_ratio(logp, old):
    return torch.exp((logp - old).clamp(-20, 20))


# ---------------------------------------------------------------- the references
def grpo_k3(b, logp, H, beta=0.04):
    # TRL 1.16.0 _compute_loss: per_token_kl = exp(ref - logp) - (ref - logp) - 1 (use_bias_correction_kl
    # off), per_token_loss = -(clipped surrogate) + β·kl; GRPO's per-response mean, then the mean over the
    # non-empty responses (the language's seq-mean-token-mean; TRL's .mean() also counts an empty one as 0)
    kl = torch.exp(b["ref"] - logp) - (b["ref"] - logp) - 1
    return seq_mean_token_mean(-ppo(host_ratio(logp, b["old"]), b["A"]) + beta * kl, b["m"])


def entropy_bonus(b, logp, H, c=0.01):
    # PPO's L^CLIP + c·S (Eq. 9), as OpenRLHF and verl subtract coef·aggregate(entropy) from the loss
    return token_mean(-ppo(host_ratio(logp, b["old"]), b["A"]), b["m"]) - c * token_mean(H, b["m"])


def ctpo(b, logp, H, clip_low=0.025, clip_high=0.05, clip_c=0.05, power=0.5):
    # horizon-llm/CTPO core_algos.py, _compute_policy_loss_cum_token_la_impl, ratio_mode="cumprod"
    mask, advantages = b["m"], b["A"]
    negative_approx_kl = torch.clamp(logp - b["old"], min=-20.0, max=20.0)
    cumulative_sum = torch.cumsum(negative_approx_kl * mask, dim=-1)
    kl_values = torch.where(mask > 0, cumulative_sum, torch.zeros_like(cumulative_sum))
    log_importance_ratio = torch.clamp(kl_values.detach() + logp - logp.detach(), max=10.0)
    ratio = torch.where(mask > 0, torch.exp(log_importance_ratio), torch.zeros_like(log_importance_ratio))
    scale = torch.cumsum(mask, dim=-1).clamp(min=1.0).pow(power)
    log_r_clipped = torch.clamp(log_importance_ratio, -clip_low * scale, clip_high * scale)
    clipped_ratio = torch.where(mask > 0, torch.exp(log_r_clipped), torch.zeros_like(log_r_clipped))
    dual = torch.where(mask > 0, torch.exp(clip_c * scale), torch.ones_like(scale))
    clip_pg_losses1 = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    clip_pg_losses2 = torch.min(-advantages * dual, clip_pg_losses1)
    return token_mean(torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1), mask)     # verl's token-mean


def otb_advantages(b, handle_zero_tail=True, epsilon=1e-8):
    # verl 0.9.1 compute_optimal_token_baseline_advantage, its returns G_t taken as the host's A
    returns, response_mask, index = b["A"], b["m"], b["groups"].tolist()
    with torch.no_grad():
        w_cumulative = ((1 - 2 * torch.exp(b["old"]) + b["spq"]) * response_mask).cumsum(dim=-1)
        baselines = torch.zeros_like(returns)
        for group in sorted(set(index)):
            trajectory_indices = [i for i, g in enumerate(index) if g == group]
            if len(trajectory_indices) == 1:
                continue
            traj_idx = torch.tensor(trajectory_indices)
            mask_group = response_mask[traj_idx]
            numerator = (returns[traj_idx] * w_cumulative[traj_idx] * mask_group).sum(dim=0)
            denominator = (w_cumulative[traj_idx] * mask_group).sum(dim=0) + epsilon
            baselines[traj_idx] = (numerator / denominator).unsqueeze(0).expand(len(traj_idx), -1)
            if handle_zero_tail:
                response_lengths = mask_group.sum(dim=-1)
                sorted_lengths, _ = torch.sort(response_lengths)
                max_length, second_max_length = int(sorted_lengths[-1].item()), int(sorted_lengths[-2].item())
                max_length_idx = (response_lengths == max_length).nonzero(as_tuple=True)[0]
                if max_length_idx.numel() == 1 and max_length > second_max_length:
                    baselines[trajectory_indices[int(max_length_idx[0])], second_max_length:] = 0.0
        return (returns - baselines) * response_mask


def otb(b, logp, H, clip_ratio_c=3.0):
    # verl's vanilla PPO loss (clip 0.2, dual clip c = 3, token-mean) on OTB's advantages
    advantages = otb_advantages(b)
    ratio = host_ratio(logp, b["old"])
    clip_pg_losses1 = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
    clip_pg_losses2 = torch.min(-advantages * clip_ratio_c, clip_pg_losses1)
    return token_mean(torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1), b["m"])


def trust_the_batch(b, logp, H):
    # FeynRL algs/P3O/p3o.py compute_policy_loss and calculate_ess, algs/RL/common.py compute_kl_distance,
    # one rank, kl_coeff = ent_coeff = 0 (its defaults); in float64 (it casts the log-ratio to float32)
    mask_bool = b["m"] > 0.5
    mask = mask_bool.to(logp.dtype)
    ratio = torch.exp(torch.where(mask_bool, logp - b["old"], torch.zeros_like(logp)))
    valid = ratio[mask_bool]
    sum_w, sum_w_2, total = valid.sum().item(), valid.pow(2).sum().item(), float(valid.numel())
    ess = (sum_w ** 2) / (sum_w_2 + 1e-8) / total
    kl = (logp - b["old"]) + torch.exp(torch.clamp(b["old"] - logp, min=-10.0, max=10.0)) - 1
    kl_sum_behavioral = (torch.where(mask_bool, kl, torch.zeros_like(kl)) * mask).sum()
    rho = torch.clamp(ratio, min=0, max=ess)
    pi_sum = -(rho.detach() * logp * b["A"] * mask).sum()
    return (pi_sum + (1 - ess) * kl_sum_behavioral) / mask.sum().clamp(min=1.0)


def oapl(b, logp, H, beta1=1.0, beta2=1e-3):
    # NeMo-RL OAPLAdvantageEstimator (V̂* = β1·(logsumexp(r/β1) − log n) per prompt) and OAPLLossFn
    # (mean over samples of (β2·Σ_t(log π − log π_gen) − Â*)²); R_i is the response's advantage. An
    # empty response has no token to read it from: left out of V̂* and of the mean, as the objective does
    m, n = b["m"], b["m"].sum(-1)
    rewards = (b["A"] * m).sum(-1) / n.clamp(min=1)
    advantage = torch.zeros_like(rewards)
    for group in set(b["groups"].tolist()):
        members = [i for i, g in enumerate(b["groups"].tolist()) if g == group and n[i] > 0]
        r = rewards[members]
        vstar = beta1 * (torch.logsumexp(r / beta1, dim=0) - math.log(len(members)))
        advantage[members] = r - vstar
    sequence_log_ratio = ((logp - b["rollout"]) * m).sum(-1)
    per_response = torch.square(beta2 * sequence_log_ratio - advantage)
    return seq_mean_token_mean(per_response[:, None].expand_as(m), m)     # the mean over responses (+1e-8, above)


REFERENCES = [grpo_k3, entropy_bonus, ctpo, otb, trust_the_batch, oapl]
PATHS = [(True, False), (False, False), (True, True)]      # (fused, sync_free)


def ours(name, b, fused=True, sync_free=False, **params):
    loss_fn = CompiledLoss(name, fused=fused, **params)
    loss_fn.sync_free = sync_free
    m = b["mask"]
    lp, h = dirty(b["new"], m).requires_grad_(), dirty(b["H"], m).requires_grad_()
    loss, _ = loss_fn(lp, dirty(b["old"], m), dirty(b["A"], m), m, rollout_log_probs=dirty(b["rollout"], m),
                      ref_log_probs=dirty(b["ref"], m), entropy=h, sum_pi_sq=dirty(b["spq"], m), groups=b["groups"])
    grads = torch.autograd.grad(loss, [lp, h], allow_unused=True)
    return loss.detach(), grads[0], grads[1]


def theirs(reference, b):
    clean = {**b, "m": b["mask"].to(F64)}
    lp, h = b["new"].clone().requires_grad_(), b["H"].clone().requires_grad_()
    loss = reference(clean, lp, h)
    grads = torch.autograd.grad(loss, [lp, h], allow_unused=True)
    return loss.detach(), grads[0], grads[1]


@pytest.mark.parametrize("fused, sync_free", PATHS, ids=["fused", "plain", "sync_free"])
@pytest.mark.parametrize("reference", REFERENCES, ids=lambda f: f.__name__)
def test_each_third_version_objective_equals_its_sources_formula_in_loss_and_gradients(reference, fused, sync_free):
    b = batch(0)
    expected, got = theirs(reference, b), ours(reference.__name__, b, fused, sync_free)
    assert torch.allclose(got[0], expected[0], rtol=1e-12, atol=1e-15), (got[0], expected[0])
    assert torch.allclose(got[1], expected[1], rtol=1e-10, atol=1e-15), (got[1] - expected[1]).abs().max()
    if expected[2] is not None and expected[2].abs().sum() > 0:      # H's own gradient (the entropy bonus)
        assert torch.allclose(got[2], expected[2], rtol=1e-12, atol=1e-16)
    else:
        assert got[2] is None


# each clip, cap and baseline changes the loss on the test batch: (objective, parameters that undo it)
ACTS = [("ctpo", dict(c_low=50, c_high=50)), ("ctpo", dict(c_dual=50)), ("grpo_k3", dict(β=0)),
        ("entropy_bonus", dict(c=0)), ("otb", dict(c=1000)), ("oapl", dict(β_1=1000))]


@pytest.mark.parametrize("name, undone", ACTS, ids=lambda x: str(x))
def test_each_clip_cap_and_baseline_acts_on_the_test_batch(name, undone):
    b = batch(0)
    (l0, g0, _), (l1, g1, _) = ours(name, b), ours(name, b, **undone)
    assert not (torch.allclose(l0, l1, rtol=1e-6) and torch.allclose(g0, g1, rtol=1e-6, atol=1e-12))


def test_the_test_batch_has_a_lone_tail_and_a_group_of_one_where_the_otb_reference_has_no_baseline():
    """A check of the test batch and the reference (no project code): the batch has both places
    where OTB's baseline is zero, so that the comparison above holds otb to them."""
    b = batch(0)
    clean = {**b, "m": b["mask"].to(F64)}
    adv = otb_advantages(clean)
    assert torch.equal(adv[1, 9:], b["A"][1, 9:]) and not torch.equal(adv[1, :9], b["A"][1, :9])   # the tail past 9
    assert torch.equal(adv[6], b["A"][6] * clean["m"][6])            # a group of one: no baseline


def test_the_test_batch_has_an_ess_below_one_that_caps_some_ratios():
    """A check of the test batch (no project code): trust_the_batch's cap and its (1 − ESS)·KL term
    both act on it, so that the comparison above holds the objective to them."""
    b = batch(0)
    ratio = torch.exp(b["new"] - b["old"])[b["mask"]]
    ess = ratio.sum() ** 2 / (ratio.square().sum() + 1e-8) / ratio.numel()
    assert 0.5 < ess < 1 and (ratio > ess).any() and (ratio < ess).any()


def test_the_library_objectives_locality_and_inputs_are_what_hosts_must_provide():
    want = {"grpo_k3": ("token", {"ref_log_probs"}), "entropy_bonus": ("token", {"entropy"}),
            "ctpo": ("response", set()), "otb": ("group", {"sum_pi_sq", "groups"}),
            "trust_the_batch": ("batch", {"batch"}), "oapl": ("response", {"rollout_log_probs", "groups"})}
    for name, (locality, inputs) in want.items():
        assert (dsl.load(name).locality(), set(CompiledLoss(name).inputs())) == (locality, inputs), name


@pytest.mark.parametrize("name, rows", [("otb", [0, 1, 2, 6]), ("oapl", [3, 4, 5, 9])])
def test_a_call_of_whole_groups_gives_those_rows_of_the_whole_batchs_gradient(name, rows):
    """Under a normalizer fixed across calls (the host's global one), each call of whole groups is
    exact; the references' own mean over the call is not that normalizer, so the check is ours against
    ours over one call of all the groups."""
    from openrlhf_drpo.core import Aggregation
    b = batch(1)
    norm = Aggregation(norm=23.0)
    loss_fn = CompiledLoss(name)
    whole = _grad(loss_fn, b, norm)
    part = {k: v[rows] for k, v in b.items()}
    assert torch.allclose(_grad(loss_fn, part, norm), whole[rows], rtol=1e-12, atol=1e-16)


def _grad(loss_fn, b, agg):
    lp = b["new"].clone().requires_grad_()
    loss, _ = loss_fn(lp, b["old"], b["A"], b["mask"], rollout_log_probs=b["rollout"], sum_pi_sq=b["spq"],
                      groups=b["groups"], aggregation=agg)
    return torch.autograd.grad(loss, lp)[0]


_VERL_OTB = """
import json, sys, numpy as np, torch
from verl.trainer.ppo.core_algos import compute_optimal_token_baseline_advantage
b = {k: torch.tensor(v, dtype=torch.float64) for k, v in json.loads(sys.stdin.read()).items()}
mask = b["mask"]
# token rewards whose reward-to-go is A on each response's tokens (its masks are contiguous)
rewards = (b["A"] - torch.nn.functional.pad(b["A"][:, 1:], (0, 1))) * mask
adv, returns = compute_optimal_token_baseline_advantage(rewards, mask, np.array(b["groups"].long().tolist()),
                                                        b["old"], b["spq"])
print(json.dumps({"advantages": adv.tolist(), "returns": returns.tolist()}))
"""


def test_otbs_baseline_is_verls_own_computation():
    """The reference above against verl 0.9.1's compute_optimal_token_baseline_advantage itself, in
    verl's venv (tests/test_verl.py's): the same advantages, the zero tail and groups of one included."""
    import json
    import subprocess
    from test_verl import VERL_PYTHON
    assert VERL_PYTHON.exists(), f"{VERL_PYTHON} is missing: run bash scripts/setup_verl.sh"
    b = batch(0)
    b["A"] = b["A"] * b["mask"]                       # the return is 0 past each response (its rewards' sum)
    payload = {k: b[k].double().tolist() for k in ("A", "old", "spq", "mask", "groups")}
    proc = subprocess.run([str(VERL_PYTHON), "-c", _VERL_OTB], input=json.dumps(payload), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verl = json.loads(proc.stdout.splitlines()[-1])
    assert torch.allclose(torch.tensor(verl["returns"], dtype=F64), b["A"], rtol=1e-12, atol=1e-12)
    clean = {**b, "m": b["mask"].to(F64)}
    assert torch.allclose(otb_advantages(clean), torch.tensor(verl["advantages"], dtype=F64), rtol=1e-12, atol=1e-14)
