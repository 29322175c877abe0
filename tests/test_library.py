"""The library's sequence-level and off-policy objectives, each held to an independent torch
implementation of its source's formula (written here from the paper or the peer's code, never
from this project's generated code), on inputs whose masked slots hold NaN and ±inf."""
import math

import pytest
import torch
from test_sequence import dirty, run

from openrlhf.models.loss import PolicyLoss
from openrlhf_drpo import ObjectiveLoss


def masked_seq_mean(x, m):
    return (x * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)


def token_mean(loss, m):
    return (loss * m).sum() / m.sum()


def seq_mean_token_mean(loss, m):
    """The mean over non-empty responses of each one's token mean."""
    n = m.sum(-1)
    per_seq = (loss * m).sum(-1) / n.clamp(min=1)
    return per_seq[n > 0].mean()


def pick(cond, a, b):
    """a where cond, else b, in float64 (torch.where of two Python floats is float32)."""
    return torch.where(cond, torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))


def ppo_objective(r, A, low=0.2, high=0.2):
    return torch.min(r * A, r.clamp(1 - low, 1 + high) * A)


def host_ratio(logp, old):
    """The ratio as OpenRLHF's and verl's PPO compute it: the log-ratio clamped to ±20 first
    (no gradient past the clamp). TRL, GSPO's and GMPO's code take the raw exp(logp - old)."""
    return torch.exp((logp - old).clamp(-20, 20))


def gspo(logp, old, roll, A, m, low=3e-4, high=4e-4):
    s = torch.exp(masked_seq_mean(logp - old, m))
    return seq_mean_token_mean(-torch.min(s * A, s.clamp(1 - low, 1 + high) * A), m)


def gmpo(logp, old, roll, A, m, eps=0.4):
    log_ratio = logp - old          # raw, as verl's geo_mean (its clamp is commented out) and TRL
    sgn = torch.sign(A)
    kept = sgn * torch.min(sgn * log_ratio, sgn * log_ratio.clamp(-eps, eps))
    per_seq = -masked_seq_mean(A, m) * torch.exp(masked_seq_mean(kept, m))     # [B, 1]
    return per_seq[m.sum(-1) > 0].mean()


def luspo(logp, old, roll, A, m, low=2e-3, high=2.5e-3):
    s = torch.exp(masked_seq_mean(logp - old, m))
    per_token = -torch.min(s * A, s.clamp(1 - low, 1 + high) * A)
    n = m.sum(-1)
    per_seq = (per_token * m).sum(-1) / n.clamp(min=1) * n           # a response's mean, times its length
    return per_seq[n > 0].mean()


def vespo(logp, old, roll, A, m):
    # the authors' compute_policy_loss_vespo: token log-ratios clamped to ±20, the TIS weight
    # π_old/π_rollout clamped to ≥ 1e-8 and its log to ±20, the sum to ±20, then w clamped to
    # ≥ 1e-8 inside log(w) alone
    log_tis = torch.log(torch.exp(old - roll).clamp(min=1e-8)).clamp(-20, 20)
    log_w = ((logp - old).clamp(-20, 20) * m).sum(-1, keepdim=True) + (log_tis * m).sum(-1, keepdim=True)
    w = torch.exp(log_w.clamp(-20, 20))
    k = pick(A >= 0, 2.0, 3.0)
    lam = pick(A >= 0, 3.0, 2.0)
    phi = torch.exp(lam + k * torch.log(w.clamp(min=1e-8)) - lam * w).detach()
    return token_mean(-phi * A * logp, m)


def sapo(logp, old, roll, A, m):
    tau = pick(A > 0, 1.0, 1.05)
    r = torch.exp((logp - old).clamp(-20, 20))
    return seq_mean_token_mean(-torch.sigmoid(tau * (r - 1)) * 4 / tau * A, m)


def gpg(logp, old, roll, A, m):
    return token_mean(-A * logp, m)


def dro(logp, old, roll, A, m, tau=0.05):
    return token_mean(-(A * logp - tau / 2 * (logp - old) ** 2), m)


def opsm(logp, old, roll, A, m, delta=0.5):
    drift = masked_seq_mean(roll - logp.detach(), m)
    keep = ~((A < 0) & (drift > delta))
    return seq_mean_token_mean(-(keep * ppo_objective(torch.exp(logp - old), A)), m)     # TRL: the raw ratio


def tis_ppo(logp, old, roll, A, m, cap=2.0):
    return token_mean(-torch.exp(old - roll).clamp(max=cap) * ppo_objective(host_ratio(logp, old), A), m)


def icepop(logp, old, roll, A, m, lo=0.5, hi=5.0):
    k = torch.exp(old - roll)
    return token_mean(-torch.where((k >= lo) & (k <= hi), k, 0.0) * ppo_objective(host_ratio(logp, old), A), m)


def seq_mask_tis(logp, old, roll, A, m, lo=0.5, hi=5.0):
    g = torch.exp(masked_seq_mean(old - roll, m))
    k = torch.where((g >= lo) & (g <= hi), torch.exp(old - roll), 0.0)
    return token_mean(-k * ppo_objective(host_ratio(logp, old), A), m)


def glm5_rollout_is(logp, old, roll, A, m, low=0.2, high=0.2):
    r = torch.exp(logp - roll)
    weight = (r * ((r > 1 - low) & (r < 1 + high))).detach()
    return token_mean(-weight * A * logp, m)


def ipo(logp, old, roll, A, m, delta=0.15):
    pi, mu = torch.exp(logp), torch.exp(old)
    # no published code: the ratio is the host's, as DPPO's box in OpenRLHF and verl
    return token_mean(-(((pi - mu).abs() <= delta) * host_ratio(logp, old) * A), m)


# The 2026 objectives. Where a source's code was read, each clamps where that code does; the
# others follow the formula (see each .dsl file's header for what was chosen and why).
def bandpo_tv(logp, old, roll, A, m, delta=0.05, clip=True, cap=10.0):
    # OpenMOSS/BandPO band.py, bandtv: r = 1 ± δ/p, the upper clamped to 1/p, the lower to 0;
    # band() then caps the upper at upper_bound_max (10 in the paper's runs)
    mu = torch.exp(old)
    lo, hi = (1 - delta / mu).clamp(min=0), torch.minimum(1 / mu, 1 + delta / mu).clamp(max=cap)
    r = host_ratio(logp, old)           # BandPO's core_algos: verl's ±20 clamp
    clipped = torch.clamp(r, min=lo, max=hi) if clip else r
    return seq_mean_token_mean(-torch.min(r * A, clipped * A), m)


def bandpo_chi2(logp, old, roll, A, m, delta=0.05, clip=True, cap=10.0):
    # bandchi2: r = 1 ± sqrt(δ(1 − p)/p), clamped as bandtv's
    mu = torch.exp(old)
    d = torch.sqrt(delta * (1 - mu) / mu)
    lo, hi = (1 - d).clamp(min=0), torch.minimum(1 / mu, 1 + d).clamp(max=cap)
    r = host_ratio(logp, old)
    clipped = torch.clamp(r, min=lo, max=hi) if clip else r
    return seq_mean_token_mean(-torch.min(r * A, clipped * A), m)


def smooth_gate(name, gate, c):
    """SAPO's objective with its sigmoid swapped for `gate`, scaled by c so that w(1) = 1."""
    def reference(logp, old, roll, A, m):
        tau = pick(A > 0, 1.0, 1.05)
        return seq_mean_token_mean(-c / tau * gate(tau * (host_ratio(logp, old) - 1)) * A, m)
    reference.__name__ = name
    return reference


sapo_erf = smooth_gate("sapo_erf", torch.erf, math.sqrt(math.pi) / 2)
sapo_atan = smooth_gate("sapo_atan", torch.atan, 1.0)
sapo_softsign = smooth_gate("sapo_softsign", lambda x: x / (1 + x.abs()), 1.0)


def topr(logp, old, roll, A, m, cap=1.0):
    # ROLL's _compute_topr_loss: SFT on positives, clamp(ratio, 0, 1).detach() on negatives,
    # the ratio exp(log_probs - old_log_probs) unclamped
    taper = torch.exp(logp - old).clamp(0, cap).detach()
    return seq_mean_token_mean(-torch.where(A >= 0, 1.0, taper) * A * logp, m)


def topr_seq(logp, old, roll, A, m, cap=1.0):
    # verl PR #6986's tests: the response's weight is 1 where its mean advantage is ≥ 0, else
    # its length-normalised ratio clamped to [0, 1], detached
    s = torch.exp(masked_seq_mean(logp - old, m))
    weight = torch.where(masked_seq_mean(A, m) >= 0, 1.0, s.clamp(0, cap)).detach()
    return seq_mean_token_mean(-weight * A * logp, m)


def gipo(logp, old, roll, A, m, sigma=0.2):
    log_r = (logp - old).clamp(-20, 20)
    trust = torch.exp(-log_r ** 2 / (2 * sigma ** 2)).detach()
    return token_mean(-trust * torch.exp(log_r) * A, m)


def binary_kl(log_p, log_q, eps=1e-8):
    """AReaL's compute_binary_kl_divergence: KL between Bernoulli(p) and Bernoulli(q)."""
    p, q = torch.exp(log_p).clamp(eps, 1 - eps), torch.exp(log_q).clamp(eps, 1 - eps)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def kpop(logp, old, roll, A, m, phi=2.0):
    # AReaL's apply_rejection_sampling (metric=binary_kl, mask) and ppo_actor_loss_fn: kept while
    # max(KL(old‖roll), KL(roll‖old)) <= φ; the behaviour weight and PPO's ratio both unclamped
    keep = torch.maximum(binary_kl(old, roll), binary_kl(roll, old)) <= phi
    pg = torch.exp(old - roll) * ppo_objective(torch.exp(logp - old), A)
    return token_mean(-torch.where(keep, pg, 0.0), m)


def vaco(logp, old, roll, A, m, delta=0.25):
    lag = masked_seq_mean((torch.exp(old) - torch.exp(roll)).abs(), m)
    return token_mean(-torch.where(lag <= delta, ppo_objective(host_ratio(logp, old), A), 0.0), m)


def pspo(logp, old, roll, A, m, alpha=0.1):
    # π smoothed toward the behaviour policy before the ratio: ((1 − α)π + αμ)/μ, no clip
    smoothed = (1 - alpha) * torch.exp(logp) + alpha * torch.exp(old)
    return token_mean(-smoothed / torch.exp(old) * A, m)


# The paper's ablations (Appendices D.2 and D.6 of "Rethinking the Divergence Regularization in LLM
# RL"), token-mean as the paper trains: each penalty as its own method writes it (DRPO's
# μ(r − 1)², SPO's (r − 1)², the online-mirror-descent log(r)²/2 of Kimi, the TV |r − 1|), and
# for the masked three only outside the Binary-TV region |π − μ| ≤ δ_tv, both directions.
def outside_binary_tv(logp, old, delta_tv):
    return ((torch.exp(logp) - torch.exp(old)).abs() > delta_tv).double()


def mask_drpo(logp, old, roll, A, m, delta_tv=0.15, delta=12.5):
    r = host_ratio(logp, old)
    penalty = A.abs() / (2 * delta) * torch.exp(old) * (r - 1) ** 2
    return token_mean(-(r * A - outside_binary_tv(logp, old, delta_tv) * penalty), m)


def mask_spo(logp, old, roll, A, m, delta_tv=0.15, eps=0.2):
    r = host_ratio(logp, old)
    penalty = A.abs() / (2 * eps) * (r - 1) ** 2
    return token_mean(-(r * A - outside_binary_tv(logp, old, delta_tv) * penalty), m)


def mask_kl(logp, old, roll, A, m, delta_tv=0.15, delta=12.5):
    log_r = (logp - old).clamp(-20, 20)      # log of the host's ratio
    penalty = A.abs() / (2 * delta) * log_r ** 2 / 2
    return token_mean(-(torch.exp(log_r) * A - outside_binary_tv(logp, old, delta_tv) * penalty), m)


def tv_no_adv(logp, old, roll, A, m, delta=12.5):
    r = host_ratio(logp, old)
    return token_mean(-(r * A - (r - 1).abs() / (2 * delta)), m)


REFERENCES = [gspo, gmpo, luspo, vespo, sapo, gpg, dro, opsm, tis_ppo, icepop, seq_mask_tis, glm5_rollout_is, ipo,
              bandpo_tv, bandpo_chi2, sapo_erf, sapo_atan, sapo_softsign, topr, topr_seq, gipo, kpop, vaco, pspo,
              mask_drpo, mask_spo, mask_kl, tv_no_adv]


# (response, token, log π − log μ, log π_old − log π_rollout): log-ratios past OpenRLHF's and
# verl's ±20 clamp both ways (where a source that clamps and one that does not part), r exactly 1
EXTREMES = [(2, 4, -25.0, 0.0), (3, 6, 25.0, 0.0), (4, 7, -60.0, 25.0), (5, 8, 60.0, -25.0),
            (6, 9, 0.0, 60.0), (7, 10, 0.0, -60.0), (8, 11, 0.0, 0.0), (9, 12, 0.0, 0.0)]


def library_batch(seed, B=10, T=14):
    """Responses drifted from their rollout by different amounts (OPSM, IcePop and the sequence
    mask all act on some and not others), with an empty and a one-token response, and the
    extreme tokens of EXTREMES, in responses of both signs of A (and r = 1 at both)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2.5 - 0.05
    new = old + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)
    new[:, :3] = old[:, :3] + 1e-4 * torch.randn(B, 3, generator=g, dtype=torch.float64)   # inside GSPO's clip
    drift = torch.linspace(-1.5, 1.5, B, dtype=torch.float64).unsqueeze(-1)
    rollout = old + drift + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    A = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0] = False
    mask[1] = False
    mask[1, 5] = True
    for b, t, log_r, log_is in EXTREMES:
        old[b, t] = -0.5 if log_r < 0 else -0.5 - log_r      # log π stays ≤ 0
        new[b, t] = old[b, t] + log_r
        rollout[b, t] = old[b, t] - log_is
        mask[b, t] = True
    A[8] = A[8].abs() + 0.1
    A[9] = -A[9].abs() - 0.1
    return new, old, rollout, A, mask


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("reference", REFERENCES, ids=lambda f: f.__name__)
def test_each_library_objective_equals_its_sources_formula(reference, fused):
    new, old, rollout, A, mask = library_batch(0)
    lp = new.clone().requires_grad_()
    expected = reference(lp, old, rollout, A, mask.double())
    expected_grad = torch.autograd.grad(expected, lp)[0]
    lp = dirty(new, mask).requires_grad_()
    got = ObjectiveLoss(reference.__name__, fused=fused)(lp, dirty(old, mask), dirty(A, mask), action_mask=mask,
                                                          rollout_log_probs=dirty(rollout, mask))[0]
    grad = torch.autograd.grad(got, lp)[0]
    # the seq-mean modes divide by count + 1e-8, as OpenRLHF: 1e-8 relative to a one-token response
    assert torch.allclose(got, expected, rtol=2e-8, atol=0), (got, expected)
    assert torch.allclose(grad, expected_grad, rtol=2e-8, atol=0), ((grad - expected_grad) / expected_grad).abs().nan_to_num().max()
    assert grad.abs().sum() > 0 and torch.all(grad[~mask] == 0)


@pytest.mark.parametrize("reference, override, effect", [
    (opsm, dict(delta=100.0), "a response is dropped"),
    (icepop, dict(lo=0.0, hi=1e9), "a token is dropped"),
    (seq_mask_tis, dict(lo=0.0, hi=1e9), "a response is dropped"),
    (glm5_rollout_is, dict(low=1.0, high=1e9), "a token leaves the band"),
    (ipo, dict(delta=1e9), "a token leaves the box"),
    (tis_ppo, dict(cap=1e9), "a weight is truncated"),
    (gspo, dict(low=1.0, high=1e9), "a response is clipped"),
    (gmpo, dict(eps=1e9), "a token's log-ratio is clipped"),
    (bandpo_tv, dict(clip=False), "a token is clipped to its band"),
    (bandpo_chi2, dict(clip=False), "a token is clipped to its band"),
    (bandpo_tv, dict(cap=1e9), "a rare token's upper bound is capped at 10"),
    (bandpo_chi2, dict(cap=1e9), "a rare token's upper bound is capped at 10"),
    (topr, dict(cap=1e9), "a negative token's ratio is tapered"),
    (topr_seq, dict(cap=1e9), "a negative response's ratio is tapered"),
    (gipo, dict(sigma=1e9), "a token's weight is damped"),
    (kpop, dict(phi=1e9), "a token is dropped"),
    (vaco, dict(delta=1e9), "a response is dropped"),
    (mask_drpo, dict(delta_tv=1e9), "a token leaves the Binary-TV region"),
    (mask_spo, dict(delta_tv=1e9), "a token leaves the Binary-TV region"),
    (mask_kl, dict(delta_tv=1e9), "a token leaves the Binary-TV region"),
])
def test_each_filter_and_clip_in_the_library_acts_on_the_test_batch(reference, override, effect):
    # the comparison above is not vacuous: with the mechanism switched off, the loss changes
    new, old, rollout, A, mask = library_batch(0)
    m = mask.double()
    # exact: the extreme tokens make some losses ~1e9, where a dropped response moves the 10th digit
    assert reference(new, old, rollout, A, m) != reference(new, old, rollout, A, m, **override), effect


def test_gmpo_takes_the_raw_log_ratio_as_verl_and_trl():
    # the case: old log-probs 0, 0, new -25, 0, A = 1. verl's geo_mean and TRL give
    # -e^-12.5 and -e^-12.5/2 on each token; a log-ratio clamped to ±20 gave -e^-10 and 0
    lp = torch.tensor([[-25.0, 0.0]], dtype=torch.float64)
    old, A, mask = torch.zeros_like(lp), torch.ones_like(lp), torch.ones_like(lp, dtype=torch.bool)
    for fused in (True, False):
        loss, grad, _ = run(ObjectiveLoss("gmpo", fused=fused), lp, old, A, mask)
        assert torch.allclose(loss, torch.tensor(-math.exp(-12.5), dtype=torch.float64), rtol=1e-14)
        assert torch.allclose(grad, torch.full_like(lp, -math.exp(-12.5) / 2), rtol=1e-14)


def vespo_floored_at_minus_20(logp, old, roll, A, m):
    """VESPO as this library first wrote it: log W clipped to ±20 only, the mismatch unclamped."""
    log_w = ((logp - old).clamp(-20, 20) * m).sum(-1, keepdim=True) + ((old - roll) * m).sum(-1, keepdim=True)
    log_w = log_w.clamp(-20, 20)
    k, lam = pick(A >= 0, 2.0, 3.0), pick(A >= 0, 3.0, 2.0)
    phi = torch.exp(k * log_w + lam * (1 - torch.exp(log_w))).detach()
    return token_mean(-phi * A * logp, m)


@pytest.mark.parametrize("reference, clamped", [
    (gmpo, lambda logp, old, *rest: gmpo(old + (logp - old).clamp(-20, 20), old, *rest)),
    (opsm, lambda logp, old, *rest: opsm(old + (logp - old).clamp(-20, 20), old, *rest)),
    (vespo, vespo_floored_at_minus_20),
    *[(ref, lambda logp, old, *rest, ref=ref: ref(old + (logp - old).clamp(-20, 20), old, *rest))
      for ref in (topr, topr_seq, kpop, pspo)],
], ids=["gmpo", "opsm", "vespo", "topr", "topr_seq", "kpop", "pspo"])
def test_the_library_batch_tells_a_clamp_its_source_does_not_have(reference, clamped):
    # the batch reaches past ±20 where it matters: a clamp the source lacks changes the gradient
    # of some token by more than rounding (relative: VESPO's weight there is ~1e-16)
    new, old, rollout, A, mask = library_batch(0)
    grads = []
    for fn in (reference, clamped):
        lp = new.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(lp, old, rollout, A, mask.double()), lp)[0])
    assert not torch.allclose(grads[0], grads[1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("name, peer", [
    ("gspo", dict(policy_loss_type="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4)),
    ("seq_mask_tis", dict(is_correction_level="seq", is_correction_mode="mask", is_correction_threshold=(0.5, 5.0))),
    ("icepop", dict(is_correction_level="token", is_correction_mode="mask", is_correction_threshold=(0.5, 5.0))),
])
def test_library_objectives_that_openrlhf_ships_equal_its_policy_loss(name, peer):
    new, old, rollout, A, mask = library_batch(1)
    out = []
    for fn in (PolicyLoss(**peer), ObjectiveLoss(name)):
        lp = new.clone().requires_grad_()
        loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = fn(lp, old, A, action_mask=mask.double(),
                                                                rollout_log_probs=rollout)
        out.append((loss.detach(), torch.autograd.grad(loss, lp)[0], clip_ratio, ppo_kl))
    assert torch.allclose(out[0][0], out[1][0], rtol=1e-12) and torch.allclose(out[0][1], out[1][1], rtol=1e-10, atol=1e-15)
    assert torch.allclose(out[0][3], out[1][3], rtol=1e-12)          # ppo_kl
    if name == "gspo":      # tokens of responses past GSPO's clip, moving away: PolicyLoss's clip_ratio
        assert 0 < out[0][2] < 1 and torch.allclose(out[0][2], out[1][2].to(out[0][2].dtype), rtol=1e-12)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_metrics_of_an_objective_on_the_raw_ratio_keep_its_weight_and_the_clamps_largest_ratio(fused):
    # PSPO's weight is 0.9 at every token, past ±20 too (its ratio is the raw exp(log π − log μ)):
    # w_mean must read 0.9 (it read 2e15 once with the clamped ratio in w), over the tokens within
    # the clamp; the largest ratio is the loss's clamp's (finite at any log-ratio: issue 30)
    new, old, rollout, A, mask = library_batch(0)
    assert ((new - old)[mask].abs() > 20).any()
    loss_fn = ObjectiveLoss("pspo", fused=fused)
    loss_fn(new.clone().requires_grad_(), old, A, action_mask=mask, rollout_log_probs=rollout)
    assert torch.isclose(loss_fn.metrics.logged()["drpo_w_mean"], torch.tensor(0.9, dtype=torch.float64), rtol=1e-12)
    assert loss_fn.metrics.logged()["drpo_ratio_max"] == torch.exp((new - old).clamp(-20, 20))[mask].max()
