"""The library's fourth-round objectives (the field's since v3 that the language already writes), each
held to an independent float64 implementation written here from its source's code or description, never
from this project's IR: loss and gradient to log π on the plain path, the fused path and the sync-free
kernels CUDA takes, on v3's batch (an empty response, unequal lengths, masked slots holding NaN and
±inf; the references get clean inputs, as the sources multiply by the mask) with responses moved past
each filter, clip and truncation, which the tests check act on it. kl_unbiased is also held to OpenRLHF
0.11.2's own compute_approx_kl and PolicyLoss (which compute the KL in float32)."""
import pytest
import torch
from test_library_v3 import LENGTHS, PATHS, batch, dirty, host_ratio, ppo, token_mean

import dsl
from openrlhf_drpo.core import Aggregation, CompiledLoss

F64 = torch.float64


def v4_batch(seed=0):
    """v3's batch with responses moved past what the new files filter, clip and truncate: response 2
    (9 tokens) far above its old and rollout policy (exp(3) = 20 past kl_unbiased's w ≤ 10, GSPO's clip
    and the geometric mask's 10), response 7 far below (past the mask's 0.1), response 5's rollout
    policy below its old one (exp(1) past the IS weight's truncation at 2), and one token's reference
    past the k1 value's ±10 clamp."""
    b = batch(seed)
    b["new"][2] += 3.0
    b["new"][7] -= 3.0
    b["rollout"][5] -= 1.0
    b["ref"][1, 3] = b["new"][1, 3] - 12.0
    return b


def mu_batch(seed=0):
    """v4_batch with one advantage per response (μ-GRPO's veto reads the response's sign) and triggers,
    tokens whose ratio to the rollout is below 1e-4: two in negative response 7 (at 2 and 5, the tokens
    between and after them vetoed, they are not), one in positive response 5 (nothing vetoed); response
    2's ratio e³ past the clip's 5 with a positive advantage."""
    b = v4_batch(seed)
    b["A"] = b["A"][:, :1].expand_as(b["A"]).clone()
    b["A"][7], b["A"][5], b["A"][2] = -b["A"][7].abs(), b["A"][5].abs(), b["A"][2].abs()
    for i, t in ((7, 2), (7, 5), (5, 1)):
        b["new"][i, t] = b["rollout"][i, t] - 12.0
    return b


BATCHES = {"mu_grpo": mu_batch}


def masked_mean_nemo(x, m, dim=None, eps=1e-8):
    """NeMo-RL nemo_rl/algorithms/utils.py masked_mean (no global factor): Σ(x·m)/(Σm + 1e-8); eps = 0
    the exact mean, an empty response's 0 as the language's (NeMo's 1e-8 gives it 0 too)."""
    return (x * m).sum(dim=dim) / (m.sum(dim=dim) + eps if eps else m.sum(dim=dim).clamp(min=1))


# ---------------------------------------------------------------- the references
def kl_unbiased(b, logp, beta=0.01, clip_eps=0.2, w_max=10.0):
    # OpenRLHF 0.11.2 models/utils.py compute_approx_kl(kl_estimator="k1", unbiased_gradient=True), in
    # float64 (it casts to float32), and ppo_actor.py's loss = actor_loss + kl_ctl·aggregate_loss(kl), the
    # PolicyLoss (ppo, ε = 0.2, token level) with its log-ratio clamped to ±20
    log_ratio = logp - b["ref"]
    value = log_ratio.clamp(min=-10, max=10)
    w = (logp - b["old"]).exp().clamp(max=w_max).detach()
    grad_surrogate = w * (log_ratio ** 2 / 2.0)
    kl = value.detach() + grad_surrogate - grad_surrogate.detach()
    actor = token_mean(-ppo(host_ratio(logp, b["old"]), b["A"], clip_eps, clip_eps), b["m"])
    return actor + beta * token_mean(kl, b["m"])


def gspo_seq_mean_is(b, logp, clip=0.2, C=2.0, eps=0.0):
    # NeMo-RL ClippedPGLossFn.__call__ (loss_functions.py at 7ea279a), sequence_level_importance_ratios,
    # LossType.SEQUENCE_LEVEL, no KL, use_importance_sampling_correction, truncated_importance_sampling_type
    # "tis" at C (min 0); its actor weight exp(sum(prev − gen)) replaced by PR #2269's sequence_mean, the
    # masked mean. NeMo's masked_mean adds 1e-8 to every count (eps = 1e-8); the file takes exact means
    # (eps = 0), and the host normalizer (global_valid_seqs, every sample) is given to both.
    m, A = b["m"], b["A"]
    seq_ratio = masked_mean_nemo(logp - b["old"], m, dim=-1, eps=eps).unsqueeze(-1).exp()
    ratios = seq_ratio.repeat(1, A.shape[1])
    clip_loss = torch.max(-A * ratios, -A * ratios.clamp(1.0 - clip, 1.0 + clip))
    weights = masked_mean_nemo(b["old"] - b["rollout"], m, dim=-1, eps=eps).exp().detach()
    weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0).unsqueeze(-1).clamp(min=0.0, max=C)
    per_seq = masked_mean_nemo(weights * clip_loss, m, dim=-1, eps=1e-8)
    return per_seq.sum() / (m.shape[0] + 1e-8)      # masked_mean over samples (sample_mask 1), global_valid_seqs


def _prime_rl(b, logp, coeff_of):
    # prime-rl's compute_loss: a per-sample loss fn over its own tokens, summed, over the global rl-token
    # count; each of PR #3384's types a detached coefficient on trainer_logprobs (inference = the rollout)
    total = 0.0
    for i in range(logp.shape[0]):
        keep = b["m"][i] > 0
        t_logp, i_logp, adv = logp[i][keep], b["rollout"][i][keep], b["A"][i][keep]
        log_ratio = t_logp - i_logp
        coeff = coeff_of(log_ratio.sum(), log_ratio.sum() / keep.sum().clamp(min=1), adv)
        total = total + -(coeff.detach() * t_logp).sum()
    return total / b["m"].sum()


def seq_tis(b, logp, C=2.0):
    # w = Π_t ρ_t from the summed log-ratio; −Σ min(w, C)·A·log π
    return _prime_rl(b, logp, lambda s, g, adv: torch.clamp(torch.exp(s), max=C) * adv)


def seq_mis(b, logp, low=0.1, high=10.0):
    # −Σ I(low ≤ w^(1/T) ≤ high)·w·A·log π, w^(1/T) = exp(mean log-ratio)
    return _prime_rl(b, logp, lambda s, g, adv: ((low <= g.exp()) & (g.exp() <= high)) * torch.exp(s) * adv)


def geo_mask(b, logp, low=0.1, high=10.0):
    # the pure filter: −Σ I(low ≤ exp(mean log-ratio) ≤ high)·A·log π
    return _prime_rl(b, logp, lambda s, g, adv: ((low <= g.exp()) & (g.exp() <= high)) * adv)


def cppo(b, logp, delta=0.2, w_min=0.8, delta_b=0.02, q=0.9):
    # UniRL unirl/algorithms/cppo.py (PR #58) _cppo_loss: −A·r, r = exp(clamp(log π − log μ, ±20)), μ the
    # rollout's, times _cppo_mask's keep (no gradient), token-mean. The mask, per response (here its unmasked
    # tokens, in order): D = |π − μ|; kept where A·(r − 1) ≤ 0 or w_t·D_t ≤ min(δ, δ + b·W_{t−1} − S_{t−1}),
    # w_t linear from 1 at the first token to w_min at the last, S and W the sums of w·D and w before t,
    # b = torch.quantile(D, 0.9) clamped to [δ_b, 2δ_b]
    ratio = host_ratio(logp, b["rollout"])
    keep = torch.zeros_like(logp)
    with torch.no_grad():
        D = (logp.exp() - b["rollout"].exp()).abs()
        toward = b["A"] * (ratio - 1) <= 0
        for i in range(logp.shape[0]):
            at = b["m"][i].nonzero().flatten()
            n = len(at)
            if n == 0:
                continue
            d = D[i, at]
            w = torch.tensor([1 - (1 - w_min) * k / max(n - 1, 1) for k in range(n)], dtype=F64)
            z = w * d
            z_before = torch.tensor([float(z[:k].sum()) for k in range(n)], dtype=F64)
            w_before = torch.tensor([float(w[:k].sum()) for k in range(n)], dtype=F64)
            budget = min(max(float(torch.quantile(d, q)), delta_b), 2 * delta_b)
            limit = torch.clamp(delta + budget * w_before - z_before, max=delta)
            keep[i, at] = (toward[i, at] | (z <= limit)).to(F64)
    return token_mean(-b["A"] * ratio * keep, b["m"])


def mu_grpo(b, logp, kappa=1e-4, eps_low=1.0, eps_high=4.0):
    # the μ-GRPO project page: GRPO's clipped surrogate at the relaxed clip [0, 5] against the behaviour
    # policy (the rollout's stored log-probs); in a negative-advantage response, the triggers T are the
    # tokens whose ratio is below κ, S_κ the tokens after the first of them (exclusive), and the
    # harmful set H_κ = S_κ \ T is masked; token-mean
    ratio = host_ratio(logp, b["rollout"])
    keep = torch.ones_like(logp)
    for i in range(logp.shape[0]):
        at = b["m"][i].nonzero().flatten().tolist()
        triggers = [t for t in at if ratio[i, t] < kappa]
        if at and b["A"][i, at].mean() < 0 and triggers:        # the response's advantage
            for t in at:
                if t > triggers[0] and t not in triggers:
                    keep[i, t] = 0.0
    return token_mean(-ppo(ratio, b["A"], eps_low, eps_high) * keep, b["m"])


REFERENCES = [kl_unbiased, gspo_seq_mean_is, seq_tis, seq_mis, geo_mask, cppo, mu_grpo]
# the host normalizer each source divides by where it is not the language's own count
NORM = {"gspo_seq_mean_is": len(LENGTHS) + 1e-8}


def ours(name, b, fused=True, sync_free=False, **params):
    loss_fn = CompiledLoss(name, fused=fused, **params)
    loss_fn.sync_free = sync_free
    m = b["mask"]
    lp = dirty(b["new"], m).requires_grad_()
    loss, _ = loss_fn(lp, dirty(b["old"], m), dirty(b["A"], m), m, rollout_log_probs=dirty(b["rollout"], m),
                      ref_log_probs=dirty(b["ref"], m), aggregation=Aggregation(norm=NORM.get(name)))
    return loss.detach(), torch.autograd.grad(loss, lp)[0]


def theirs(reference, b, **kw):
    lp = b["new"].clone().requires_grad_()
    loss = reference({**b, "m": b["mask"].to(F64)}, lp, **kw)
    return loss.detach(), torch.autograd.grad(loss, lp)[0]


@pytest.mark.parametrize("fused, sync_free", PATHS, ids=["fused", "plain", "sync_free"])
@pytest.mark.parametrize("reference", REFERENCES, ids=lambda f: f.__name__)
def test_each_v4_objective_equals_its_sources_formula_in_loss_and_gradient(reference, fused, sync_free):
    b = BATCHES.get(reference.__name__, v4_batch)()
    (l0, g0), (l1, g1) = theirs(reference, b), ours(reference.__name__, b, fused, sync_free)
    assert torch.isfinite(g0).all() and g0.abs().sum() > 0
    assert torch.allclose(l1, l0, rtol=1e-12, atol=1e-15), (l1, l0)
    assert torch.allclose(g1, g0, rtol=1e-10, atol=1e-15), (g1 - g0).abs().max()


def test_nemo_rls_own_masked_means_differ_from_the_files_exact_ones_by_their_1e_8_alone():
    """The file takes exact means where NeMo-RL's masked_mean divides by n + 1e-8: with NeMo's own
    means the loss and gradient agree to 1e-8 relative, and no closer than that suggests a stray term."""
    b = v4_batch()
    (l0, g0), (l1, g1) = theirs(gspo_seq_mean_is, b, eps=1e-8), ours("gspo_seq_mean_is", b)
    assert torch.allclose(l1, l0, rtol=1e-8, atol=0) and torch.allclose(g1, g0, rtol=1e-7, atol=1e-12)


# each filter, clip and truncation changes the loss or the gradient on the test batch:
# (objective, parameters that undo it)
ACTS = [("kl_unbiased", dict(β=0)), ("kl_unbiased", dict(w_max=1e30)), ("kl_unbiased", dict(ε_low=100, ε_high=100)),
        ("gspo_seq_mean_is", dict(C=1e30)), ("gspo_seq_mean_is", dict(ε_low=100, ε_high=100)),
        ("seq_tis", dict(C=1e30)), ("seq_mis", dict(low=0, high=1e30)), ("geo_mask", dict(low=0)),
        ("geo_mask", dict(high=1e30)), ("cppo", dict(δ=1e30)), ("cppo", dict(δ_b=10)), ("cppo", dict(w_min=1)),
        ("cppo", dict(q=0)), ("mu_grpo", dict(κ=0)), ("mu_grpo", dict(ε_high=1e30))]


@pytest.mark.parametrize("name, undone", ACTS, ids=lambda x: str(x))
def test_each_v4_clip_filter_and_truncation_acts_on_the_test_batch(name, undone):
    b = BATCHES.get(name, v4_batch)()
    (l0, g0), (l1, g1) = ours(name, b), ours(name, b, **undone)
    assert not (torch.allclose(l0, l1, rtol=1e-6) and torch.allclose(g0, g1, rtol=1e-6, atol=1e-12))


def test_kl_unbiaseds_kl_value_is_clamped_but_its_gradient_is_the_importance_weighted_reverse_kl():
    """The straight-through split, on the test batch: the KL's value changes where the ±10 clamp acts,
    its gradient does not (a check of the reference's transcription against the PR's statement that the
    gradient is w·log(π/π_ref)·∇log π whatever the value)."""
    b = v4_batch()
    clean = {**b, "m": b["mask"].to(F64)}
    lp = b["new"].clone().requires_grad_()
    kl = kl_unbiased(clean, lp) - kl_unbiased(clean, lp, beta=0)
    grad = torch.autograd.grad(kl, lp)[0]
    x, w = b["new"] - b["ref"], (b["new"] - b["old"]).exp().clamp(max=10)
    assert torch.allclose(kl.detach(), 0.01 * token_mean(x.clamp(-10, 10), clean["m"]), rtol=1e-12)
    assert torch.allclose(grad, 0.01 * w * x * clean["m"] / clean["m"].sum(), rtol=1e-12, atol=1e-18)
    assert ((b["new"] - b["ref"]).abs() > 10)[b["mask"]].any() and (w == 10)[b["mask"]].any()


def test_kl_unbiased_equals_openrlhfs_own_compute_approx_kl_and_policy_loss():
    """OpenRLHF 0.11.2's own code as ppo_actor.py combines it (--algo.kl.use_loss --algo.kl.unbiased_gradient,
    k1, init_coef 0.01): compute_approx_kl casts to float32, so the KL term agrees to float32 rounding."""
    from openrlhf.models.loss import PolicyLoss, aggregate_loss
    from openrlhf.models.utils import compute_approx_kl
    b = v4_batch()
    m = b["mask"].to(F64)
    lp = b["new"].clone().requires_grad_()
    actor, *_ = PolicyLoss()(lp, b["old"], b["A"], action_mask=m)
    kl = compute_approx_kl(lp, b["ref"], log_probs_old=b["old"], kl_estimator="k1", unbiased_gradient=True)
    loss = actor + aggregate_loss(kl, m) * 0.01
    grad = torch.autograd.grad(loss, lp)[0]
    l1, g1 = ours("kl_unbiased", b)
    assert torch.allclose(l1, loss.detach().double(), rtol=1e-7) and torch.allclose(g1, grad.double(), rtol=1e-6, atol=1e-9)


def test_the_v4_objectives_locality_and_inputs_are_what_hosts_must_provide():
    want = {"kl_unbiased": ("token", {"ref_log_probs"}), "gspo_seq_mean_is": ("response", {"rollout_log_probs"}),
            "seq_tis": ("response", {"rollout_log_probs"}), "seq_mis": ("response", {"rollout_log_probs"}),
            "geo_mask": ("response", {"rollout_log_probs"}), "cppo": ("response", {"rollout_log_probs"}),
            "mu_grpo": ("response", {"rollout_log_probs"})}
    for name, (locality, inputs) in want.items():
        assert (dsl.load(name).locality(), set(CompiledLoss(name).inputs())) == (locality, inputs), name
