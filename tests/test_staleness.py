"""The language's fourth version, staleness (issue 38, item 3): a built-in for the number of policy
versions between the behaviour policy that sampled a token and the current one, a constant during
the update; AReaL's proximal approximation held to a reference written after AReaL's own code; each
host gives it (0 where it generates synchronously) or refuses it by name."""
import math
import types

import pytest
import torch

import dsl
from openrlhf_drpo.core import CompiledLoss

F64 = torch.float64
STALENESS = [0, 1, 2, 3, 7]


def batch(seed=0, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[3] = False                                          # an empty response
    behave = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.05
    new = behave + 1.2 * torch.randn(B, T, generator=g, dtype=F64)   # clipped ratios and weights past the cap
    A = torch.randn(B, T, generator=g, dtype=F64)
    stale = torch.tensor(STALENESS, dtype=F64)[torch.randint(0, len(STALENESS), (B, T), generator=g)]
    return new, behave, A, mask, stale


def dirty(x, mask):
    junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype).repeat(x.numel() // 3 + 1)
    return torch.where(mask, x, junk[: x.numel()].view_as(x))


def areal_reference(new, behave, A, mask, staleness, eps=0.4, cap=5.0, current=100.0):
    """AReaL's decoupled PPO loss with prox_logp_method loglinear, written after inclusionAI/AReaL's
    compute_prox_logp_approximations and ppo_actor_loss_fn (read, not copied): versions v_behave =
    v_θ − staleness, v_prox = v_θ − 1, α = (v_prox − v_behave)/(v_θ − v_behave) where v_θ > v_behave
    (else 0) clamped to [0, 1]; log π_prox = log π_behave + α·(log π_θ − log π_behave) on the detached
    log π_θ; the clipped surrogate on π_θ/π_prox times π_prox/π_behave, zeroed above the cap; the
    token mean over the mask. Returns (loss, ∂loss/∂log π) in float64."""
    logp = new.clone().requires_grad_()
    v_behave, v_theta, v_prox = current - staleness, current, current - 1
    diff, gap = v_theta - v_behave, v_prox - v_behave
    alpha = torch.where(diff > 0, gap / torch.where(diff > 0, diff, 1.0), 0.0).clamp(0.0, 1.0)
    prox = behave + alpha * (logp.detach() - behave)
    ratio = torch.where(mask, torch.exp(logp - prox), 0.0)
    pg = torch.maximum(-A * ratio, -A * torch.clamp(ratio, 1 - eps, 1 + eps))
    weight = torch.exp(prox - behave)
    kept = (weight <= cap) & mask
    pg = pg * torch.where(kept, weight, 0.0)
    loss = torch.where(mask, pg, 0.0).sum() / mask.sum()
    return loss.detach(), torch.autograd.grad(loss, logp)[0]


@pytest.mark.parametrize("fused, sync_free", [(False, False), (True, False), (True, True)],
                         ids=["plain", "fused", "sync-free"])
def test_areal_proximal_approximation_equals_arealss_own_loss_on_every_path(fused, sync_free):
    new, behave, A, mask, stale = batch()
    want_loss, want_grad = areal_reference(new, behave, A, mask, stale)
    loss_fn = CompiledLoss("areal_prox", fused=fused)
    loss_fn.sync_free = sync_free
    for clean in (True, False):       # NaN and ±inf in every masked slot change nothing
        fix = (lambda x: x) if clean else (lambda x: dirty(x, mask))     # noqa: E731
        lp = fix(new).requires_grad_()
        loss, _ = loss_fn(lp, torch.zeros_like(new), fix(A), mask, rollout_log_probs=fix(behave),
                          staleness=fix(stale))
        grad, = torch.autograd.grad(loss, lp)
        assert torch.allclose(loss, want_loss, rtol=1e-12, atol=0), (loss, want_loss)
        assert torch.allclose(torch.where(mask, grad, 0.0), want_grad, rtol=1e-10, atol=1e-15)
        assert not grad[~mask].any()


def test_at_staleness_zero_and_one_the_proximal_policy_is_the_behaviour_policy_ppo_on_it():
    new, behave, A, mask, _ = batch(1)
    ppo = dsl.parse("@anchor = rollout\nmin(r*A, clip(r, 0.6, 1.4)*A)")
    want = CompiledLoss(ppo)(new, new, A, mask, rollout_log_probs=behave).loss
    for s in (0.0, 1.0):
        got = CompiledLoss("areal_prox")(new, new, A, mask, rollout_log_probs=behave,
                                         staleness=torch.full_like(new, s)).loss
        assert torch.allclose(got, want, rtol=1e-13, atol=0), s
    stale = CompiledLoss("areal_prox")(new, new, A, mask, rollout_log_probs=behave,
                                       staleness=torch.full_like(new, 3.0)).loss
    assert not torch.allclose(stale, want, rtol=1e-6, atol=0)    # past one version it moves (the check can fail)


@pytest.mark.parametrize("text, level, locality", [
    ("r*A*exp(-staleness)", "token", "token"),
    ("r*A*seq_mean(staleness)", "token", "token"),
    ("seq_mean(r*A/(1 + staleness))", "response", "response"),
])
def test_staleness_is_a_token_level_input_without_gradient(text, level, locality):
    obj = dsl.parse(text)
    assert obj.facts.level[obj.expr] == level and obj.locality() == locality and obj.facts.third_version
    assert "staleness" in CompiledLoss(obj).inputs()


def test_an_objective_reading_only_staleness_has_no_gradient_and_is_refused():
    with pytest.raises(dsl.DslError, match="gradient"):
        dsl.parse("A*staleness")


@pytest.mark.parametrize("staleness, message", [
    (None, r"^objective 'areal_prox' uses staleness \(each token's policy versions behind the current one\), but no "
           r"staleness was given \(staleness=, one per token\)"),
    (torch.zeros(4, 5, dtype=torch.long), r"^CompiledLoss: staleness is torch.int64: pass floating-point values "
                                          r"\(staleness.float\(\)\)"),
    (torch.zeros(4, 1), r"^CompiledLoss: staleness is \[4, 1\], log_probs \[4, 5\]: every per-token input has "
                        r"log_probs' shape \[batch, tokens\]"),
    (torch.full((4, 5), math.nan), r"^CompiledLoss: staleness \[4, 5\] holds a value that is not a finite count ≥ 0 "
                                   r"on an unmasked token \(nan\): pass each token's number of policy versions"),
    (torch.full((4, 5), -1.0), r"^CompiledLoss: staleness \[4, 5\] holds a value that is not a finite count ≥ 0 on "
                               r"an unmasked token \(-1.0\)"),
])
def test_staleness_is_checked_at_the_tensor_boundary_naming_tensor_shape_and_fix(staleness, message):
    x = torch.zeros(4, 5)
    with pytest.raises(ValueError, match=message):
        CompiledLoss("areal_prox")(x, x, x, torch.ones(4, 5), rollout_log_probs=x, staleness=staleness)


def test_a_nan_staleness_on_a_masked_token_is_accepted():
    x, mask = torch.zeros(4, 5), torch.ones(4, 5, dtype=torch.bool)
    mask[0, 0] = False
    stale = torch.zeros(4, 5)
    stale[0, 0] = math.nan
    loss = CompiledLoss("areal_prox")(x, x, x, mask, rollout_log_probs=x, staleness=stale).loss
    assert torch.isfinite(loss)


def test_drpo_train_refuses_staleness_with_partial_rollouts_naming_the_flag(tmp_path):
    from test_train import train_flags
    from openrlhf_drpo.hosts.openrlhf.train import openrlhf_args
    path = tmp_path / "stale.dsl"
    path.write_text("r*A*exp(-0.1*staleness)\n")
    with pytest.raises(SystemExit) as exit_:
        openrlhf_args(train_flags(tmp_path, "unused", str(path), "--train.async_enable", "--train.partial_rollout_enable"))
    assert exit_.value.code.startswith(
        "drpo-train: error: objective 'stale' uses staleness (each token's policy versions behind the current one), "
        "but --train.partial_rollout_enable: OpenRLHF 0.11.2 pauses vLLM's generation for each weight broadcast and "
        "resumes it with the new weights"), exit_.value.code
    openrlhf_args(train_flags(tmp_path, "unused", str(path), "--train.async_enable"))      # asynchronous: given
    openrlhf_args(train_flags(tmp_path, "unused", str(path)))       # synchronous: 0


def test_drpo_train_gives_staleness_zero_in_its_synchronous_steps():
    from openrlhf_drpo.hosts.openrlhf.inputs import supplied
    from openrlhf_drpo.hosts.openrlhf.loss import ObjectiveLoss
    loss = ObjectiveLoss(dsl.parse("r*A*exp(-0.1*staleness)", "stale.dsl"))
    experience = types.SimpleNamespace(action_mask=torch.ones(2, 3, dtype=torch.bool))
    with supplied(loss, types.SimpleNamespace(actor=types.SimpleNamespace(), args=None), experience):
        assert loss.given["staleness"].tolist() == [[0.0] * 3] * 2
    with pytest.raises(ValueError, match=r"no staleness was given \(staleness=, one per token\): drpo-train gives it"):
        loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), action_mask=experience.action_mask)


def test_trl_gives_staleness_zero():
    from openrlhf_drpo.hosts.trl import TrlObjectiveLoss, _turns_and_staleness
    loss = TrlObjectiveLoss("areal_prox")
    assert not _turns_and_staleness(loss.inputs(), {}, torch.ones(2, 3))["staleness"].any()


def test_verl_refuses_staleness_naming_why_in_its_terms():
    from test_verl import verl_python      # verl runs in its own venv
    proc = verl_python("import dsl\nfrom openrlhf_drpo.hosts.verl import VerlObjectiveLoss\n"
                       "VerlObjectiveLoss(dsl.parse('r*A*exp(-0.1*staleness)', 'stale.dsl'))")
    assert ("ValueError: objective 'stale' uses staleness (each token's policy versions behind the current one), "
            "but verl gives a policy loss no policy versions") in proc.stderr, proc.stderr


def test_the_analysis_holds_staleness_and_says_so():
    from openrlhf_drpo.analysis import analyze
    res = analyze("areal_prox")
    assert any(h["name"] == "staleness" and h["value"] == 1 and "staleness = 1 policy versions" in h["text"]
               for h in res.scope["held"])
    # two versions behind: π_prox = sqrt(μ·π), so the clip binds at q = sqrt(r) = 1.4, r = 1.96
    two = analyze("areal_prox", held={"staleness": 2})
    assert "1.96" in str(two.boundary), two.boundary
    with pytest.raises(ValueError, match="staleness counts policy versions, at least 0"):
        analyze("areal_prox", held={"staleness": -1})
