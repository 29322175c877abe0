"""The language's third and fourth versions' inputs for any compiled objective, beside log π, μ and A:
what the tests that run every shipped objective pass, each only where the objective reads it
(CompiledLoss.inputs()). Seeded; Σ_v π_v² ≥ π² as a distribution's is; two responses per group;
turns of three tokens; staleness 0 to 3 versions; a top-3 support that is part of a distribution,
the policy's with a gradient of its own."""
import torch

K = 3       # the vocabulary support's size: its log-probs, [B, T, K]


def r_analysed(names) -> list:
    """Those of `names` (shipped) with no vocabulary sum (the objective's facts): the r-analysis and the
    tests of ∂ℓ/∂log π hold them; a vocabulary sum's gradient goes to the support's log-probs through
    the softmax, where tests/test_vocabulary.py holds every path, and drpo-analyze refuses it, located."""
    import dsl
    return [n for n in names if not dsl.load(n).facts.vocabulary]


def extra_inputs(loss_fn, logp, seed=0, dtype=None) -> dict:
    reads = loss_fn.inputs()
    logp = logp.detach()
    dtype = dtype or logp.dtype
    g = torch.Generator().manual_seed(seed)
    noise = lambda: torch.rand(logp.shape, generator=g, dtype=torch.float64)      # noqa: E731
    pi = torch.exp(logp.double())
    out = {"ref_log_probs": logp.double() + 0.4 * (noise() - 0.5), "entropy": 2 * noise(),
           "sum_pi_sq": pi ** 2 + noise() * (1 - pi) ** 2}
    out = {k: v.to(dtype) for k, v in out.items() if k in reads}
    if "entropy" in out:     # H is the policy's, with a gradient of its own (the loss refuses a detached one)
        out["entropy"].requires_grad_()
    if "groups" in reads:
        out["groups"] = torch.arange(logp.shape[0]) // 2
    if "turns" in reads:
        out["turns"] = (torch.arange(logp.shape[-1]) // 3).expand(logp.shape).to(logp.device)
    if "staleness" in reads:
        out["staleness"] = torch.randint(0, 4, logp.shape, generator=g).to(device=logp.device, dtype=dtype)
    for key in ("vocab_log_probs", "vocab_ref_log_probs"):      # K entries of a distribution over K + 2
        if key in reads:
            z = 2 * torch.randn((*logp.shape, K + 2), generator=g, dtype=torch.float64)
            out[key] = z.log_softmax(-1)[..., :K].to(device=logp.device, dtype=dtype)
    if "vocab_log_probs" in out:     # the support's log π is the policy's, with its gradient (as H)
        out["vocab_log_probs"].requires_grad_()
    return out
