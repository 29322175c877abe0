"""The fourth version's vocabulary sums (docs/language.md): ref_topk_sum(x) and topk_sum(x) over a
token's top-k support, with π_v and π_ref_v per entry. Held here: the parse and its located errors,
the level and locality, the analysis's refusal, every path's gradient to autograd and to an
independent float64 full-softmax reference on a tiny vocabulary, verl's top-k KL formulas, the
chunked support log-probs from the hidden states, and each host's refusal by name."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import dsl
from dsl.levels import levels
from dsl.vocabulary import support
from openrlhf_drpo.core import CompiledLoss

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORWARD_TAIL = (ROOT / "objectives" / "opd_topk_tail.dsl").read_text(encoding="utf-8")
REVERSE = (ROOT / "examples" / "opd_reverse_topk.dsl").read_text(encoding="utf-8")
TINY = 1.1754943508222875e-38        # torch.finfo(torch.float32).tiny, verl's floor of the teacher tail's log


def test_a_vocabulary_sum_parses_with_its_level_its_locality_and_its_support():
    obj = dsl.parse(FORWARD_TAIL, "opd.dsl")
    level = levels(obj.expr)
    sums = obj.facts.vocabulary
    assert {n.op for n in sums} == {"ref_topk_sum"} and all(level[n] == "token" for n in sums)
    assert {level[n.args[0]] for n in sums} == {"entry"}
    assert obj.locality() == "token" and obj.facts.kept_whole == () and support(obj.expr) == "reference"
    assert support(dsl.parse(REVERSE).expr) == "policy"
    assert dsl.parse("seq_mean(topk_sum(π_v*log(π_v)))*r").locality() == "response"   # a sum is a token's value
    assert dsl.parse(obj.canonical()).expr == obj.expr


@pytest.mark.parametrize("text, col, message", [
    ("π_v*A", 1, "π_v is the probability of one vocabulary entry: it is read only inside"),
    ("r*A + log(π_ref_v)", 11, "π_ref_v is the probability of one vocabulary entry"),
    ("ref_topk_sum(A*π_v)", 14, "ref_topk_sum(...) reads vocabulary entries, numbers and parameters only: 'A'"),
    ("ref_topk_sum(π_v*r)", 18, "'r' is one value per token"),
    ("topk_sum(seq_sum(π_v))", 10, "topk_sum(...) cannot hold the reduction 'seq_sum(π_v)'"),
    ("topk_sum(topk_sum(π_v))", 10, "cannot hold the reduction 'topk_sum(π_v)'"),
    ("ref_topk_sum(2)*r", 1, "ref_topk_sum(2) reads no vocabulary entry"),
    ("ref_topk_sum(π_v) + topk_sum(π_v)", 21, "'topk_sum' sums over another support than 'ref_topk_sum'"),
    ("sg(topk_sum(π_v))", 1, "the objective does not depend on the policy"),
])
def test_a_misplaced_entry_or_vocabulary_sum_is_a_located_error(text, col, message):
    with pytest.raises(dsl.DslError) as e:
        dsl.parse(text)
    assert message in e.value.message and (e.value.line, e.value.col) == (1, col), e.value.render()


def test_drpo_analyze_refuses_the_r_analysis_of_a_vocabulary_sum_by_name(tmp_path, capsys):
    from openrlhf_drpo.cli import analyze_main
    path = tmp_path / "opd.dsl"
    path.write_text("r*A - 0.1*ref_topk_sum(π_ref_v*(log(π_ref_v) - log(π_v)))\n", encoding="utf-8")
    assert analyze_main([str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:1:11: error: the r-analysis does not apply to the vocabulary sum ref_topk_sum(...)")
    assert "no weight w, boundary or range of r describes it" in err and "Traceback" not in err
    assert analyze_main([str(path), "--emit-torch"]) == 0        # its torch code is still shown
    assert "b.vocab_logp.movedim(-1, 0)" in capsys.readouterr().out
    assert analyze_main(["--equiv", "ppo", str(path)]) == 2          # the comparison is in r too: refused alike
    assert capsys.readouterr().err.startswith(f"{path}:1:11: error: the r-analysis does not apply")


# ---------------------------------------------------------------- gradients, on a tiny vocabulary
B, T, V, K = 3, 5, 7, 3
MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)


def _batch(seed, peaked=False):
    """Random logits and teacher; `peaked`: the policy's mass on the teacher's top-1 within e^-40 of 1,
    so that its tail (~1e-17) is below verl's tail_mass_eps and clamped there."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 1.5
    teacher = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2.0).log_softmax(-1)
    if peaked:
        logits = logits.scatter_add(-1, teacher.argmax(-1, keepdim=True), torch.full((B, T, 1), 40.0,
                                                                                      dtype=torch.float64))
    return logits, teacher, torch.randint(0, V, (B, T), generator=g), torch.randn(B, T, generator=g,
                                                                                   dtype=torch.float64)


def _coarse(p, t, support, f):
    """Σ over the support of f(p_v, t_v), by an explicit loop over the vocabulary (the reference)."""
    total = torch.zeros(p.shape[:-1], dtype=p.dtype)
    for v in range(p.shape[-1]):
        inside = (support == v).any(-1)
        total = total + torch.where(inside, f(p[..., v], t[..., v]), 0.0)
    return total


def _full_softmax_reference(name, logits, teacher, tokens, A):
    """The objective's per-token value from the full softmax in float64: independent of the
    compiled code (no generated function, no gather of log-probs)."""
    p, t = logits.softmax(-1), teacher.exp()
    if name == "forward_tail":
        support = teacher.topk(K, -1).indices
        P, Q = _coarse(p, t, support, lambda a, b: b), _coarse(p, t, support, lambda a, b: a)
        head = _coarse(p, t, support, lambda a, b: b * (b.log() - a.log()))
        tt = (1 - P).clamp(0, 1)
        return -(head + tt * (tt.clamp_min(TINY).log() - (1 - Q).clamp(1e-7, 1).log()))
    support = logits.detach().topk(K, -1).indices
    reverse = _coarse(p, t, support, lambda a, b: a * (a.log() - b.log()))
    if name == "reverse":
        return -reverse
    pi = p.gather(-1, tokens[..., None])[..., 0]
    return pi / pi.detach() * A - 0.5 * reverse           # a policy-gradient term beside it (r = π/π_old)


OBJECTIVES = {"forward_tail": FORWARD_TAIL, "reverse": REVERSE,
              "pg_plus_reverse": "r*A + 0.5*topk_sum(π_v*(log(π_v) - log(π_ref_v)))*(-1)"}
PATHS = {"plain": dict(fused=False), "fused": dict(fused=True), "sync_free": dict(fused=True, sync_free=True)}


DIRT = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64)


def _compiled_gradient(text, path, logits, teacher, tokens, A):
    options = dict(PATHS[path])
    sync_free = options.pop("sync_free", False)
    loss_fn = CompiledLoss(dsl.parse(text, "v.dsl"), compile=False, **options)
    loss_fn.sync_free = sync_free
    z = logits.clone().requires_grad_(True)
    lp = z.log_softmax(-1)
    index = teacher.topk(K, -1).indices if loss_fn.support == "reference" else z.detach().topk(K, -1).indices
    logp = lp.gather(-1, tokens[..., None])[..., 0]
    dirty = lambda x: torch.where(MASK[..., None], x, DIRT)     # noqa: E731  masked slots hold NaN and ±inf
    given = dirty(lp.gather(-1, index))
    loss, _ = loss_fn(logp, logp.detach(), A, MASK, vocab_log_probs=given,
                      vocab_ref_log_probs=dirty(teacher.gather(-1, index)))
    grad, to_given = torch.autograd.grad(loss, [z, given])
    assert to_given.isfinite().all() and not to_given[~MASK].any()    # what the host's softmax receives
    return loss.detach(), grad


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", OBJECTIVES)
@pytest.mark.parametrize("seed, peaked", [(0, False), (1, False), (2, True)])
def test_each_path_gives_the_float64_full_softmax_references_loss_and_logit_gradient(name, path, seed, peaked):
    logits, teacher, tokens, A = _batch(seed, peaked)
    loss, grad = _compiled_gradient(OBJECTIVES[name], path, logits, teacher, tokens, A)
    z = logits.clone().requires_grad_(True)
    per_token = _full_softmax_reference(name, z, teacher, tokens, A)
    want = -torch.where(MASK, per_token, 0.0).sum() / MASK.sum()
    want_grad, = torch.autograd.grad(want, z)
    assert torch.allclose(loss, want.detach(), rtol=1e-12, atol=1e-13), (loss, want)
    assert torch.allclose(grad, want_grad, rtol=1e-10, atol=1e-13), (grad - want_grad).abs().max()
    assert not grad[~MASK].any()         # a masked token's logits get nothing


def _verl_forward_kl_topk_tail(student_logits, teacher_topk_logp, index, eps):
    """verl #7855's forward_kl_topk_tail written from its math (head KL on the teacher's top-k plus
    the tail bucket, the student tail clamped to [eps, 1], the teacher's to [0, 1] with its log
    floored at fp32's tiny), and its analytic gradient with respect to the logits (the tail's
    gradient dropped where the student tail is clamped: tail_is_active)."""
    q = student_logits.softmax(-1)
    log_q = student_logits.log_softmax(-1).gather(-1, index)
    p = teacher_topk_logp.exp()
    P, Q = p.sum(-1), log_q.exp().sum(-1)
    tt, raw = (1 - P).clamp(0, 1), 1 - Q
    st = raw.clamp(eps, 1)
    loss = (p * (teacher_topk_logp - log_q)).sum(-1) + tt * (tt.clamp_min(TINY).log() - st.log())
    active = raw > eps
    outside = torch.where(active, P - tt * Q / st, P)
    grad = q * outside[..., None]
    topk_scale = P + torch.where(active, tt, 0.0)
    grad = grad.scatter_add(-1, index, (topk_scale - outside)[..., None] * q.gather(-1, index) - p)
    return loss, grad


@pytest.mark.parametrize("seed, peaked", [(0, False), (3, False), (4, True)])
def test_the_forward_kl_with_its_tail_is_verls_loss_and_verls_analytic_logit_gradient(seed, peaked):
    logits, teacher, tokens, A = _batch(seed, peaked)
    index = teacher.topk(K, -1).indices
    loss, grad = _compiled_gradient(FORWARD_TAIL, "fused", logits, teacher, tokens, A)
    kl, dkl = _verl_forward_kl_topk_tail(logits, teacher.gather(-1, index), index, 1e-7)
    clamped = 1 - logits.softmax(-1).gather(-1, index).sum(-1) <= 1e-7
    assert clamped[MASK].all() if peaked else not clamped.any()      # both sides of verl's tail_is_active
    n = MASK.sum()
    assert torch.allclose(loss, torch.where(MASK, kl, 0.0).sum() / n, rtol=1e-12)
    # the loss is +KL per token (the objective is −KL, maximized), token-mean
    assert torch.allclose(grad, torch.where(MASK[..., None], dkl, 0.0) / n, rtol=1e-9, atol=1e-14)


def test_the_support_is_checked_at_the_tensor_boundary():
    loss_fn = CompiledLoss(dsl.parse(REVERSE), fused=False)
    lp = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True).log_softmax(-1)
    logp, ref = lp[..., 0], lp.detach()
    with pytest.raises(ValueError, match=r"CompiledLoss: vocab_log_probs is \[2, 3\], log_probs \[2, 3\]: pass the "):
        loss_fn(logp, logp.detach(), torch.ones(2, 3), vocab_log_probs=lp[..., 0], vocab_ref_log_probs=ref)
    with pytest.raises(ValueError, match=r"hold different supports \(k = \[2, 4\]\)"):
        loss_fn(logp, logp.detach(), torch.ones(2, 3), vocab_log_probs=lp[..., :2], vocab_ref_log_probs=ref)
    with pytest.raises(ValueError, match=r"vocab_log_probs \[2, 3, 4\] has no gradient while log_probs has one"):
        loss_fn(logp, logp.detach(), torch.ones(2, 3), vocab_log_probs=lp.detach(), vocab_ref_log_probs=ref)
    with pytest.raises(ValueError, match=r"uses π_ref_v .*, but no reference support log-probs were given"):
        loss_fn(logp, logp.detach(), torch.ones(2, 3), vocab_log_probs=lp)


# ---------------------------------------------------------------- the support from the hidden states
@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("temperature, bias", [(1.0, False), (0.7, True)])
def test_the_chunked_support_log_probs_and_their_gradient_equal_autograd_through_the_full_softmax(
        chunk, given, temperature, bias):
    from openrlhf_drpo.hosts.openrlhf.support import support_logprobs
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    index = torch.randint(0, 11, (2, 5, K), generator=g) if given else None
    out, where = support_logprobs(hidden, weight, b, index, K, temperature, chunk)
    z = (hidden @ weight.T + (0 if b is None else b)).float() / temperature      # fp32, as the host's logits
    want_where = z.detach().topk(K, -1).indices if index is None else index
    want = z.log_softmax(-1).gather(-1, want_where)
    assert torch.equal(where, want_where) and not where.requires_grad
    assert torch.allclose(out, want, atol=1e-6)
    seed = torch.randn(out.shape, generator=g, dtype=torch.float32)
    got = torch.autograd.grad((out * seed).sum(), [hidden, weight] + [b] * bias)
    exp = torch.autograd.grad((want * seed).sum(), [hidden, weight] + [b] * bias)
    for x, y in zip(got, exp):
        assert torch.allclose(x, y, atol=1e-5), (x - y).abs().max()


# ---------------------------------------------------------------- the hosts
HOSTS = {
    "trl": ("from openrlhf_drpo.hosts.trl import TrlObjectiveLoss as Host",
            "ObjectiveGRPOTrainer: objective '{}' uses π_v (the policy's log-probs on each token's top-k support, "
            "with their gradient), but TRL's GRPOTrainer gives its loss the sampled token's log-probs and entropies "
            "only (its LM head keeps no logits over the vocabulary, and it has no teacher's top-k)"),
    "openrlhf": ("from openrlhf_drpo.hosts.openrlhf.loss import ObjectiveLoss as Host",
                 "objective '{}' uses π_v (the policy's log-probs on each token's top-k support, with their "
                 "gradient), but drpo-train gives π_ref's top-k only (ref_topk_sum): topk_sum sums over the current "
                 "policy's top-k"),
    "verl": ("from openrlhf_drpo.hosts.verl import VerlObjectiveLoss as Host",
             "objective '{}' uses π_v (the policy's log-probs on each token's top-k support, with their gradient), "
             "but verl gives a policy loss the sampled token's log-probs only: its top-k KL is computed from the "
             "logits in its distillation loss's logits processor"),
}


# drpo-train gives π_ref's top-k (ref_topk_sum; its command line's refusals: tests/test_vocabulary_train.py)
REFUSED = {host: [name for name in ("opd_topk_tail", "opd_reverse_topk") if (host, name) != ("openrlhf", "opd_topk_tail")]
           for host in HOSTS}
FILES = {"opd_topk_tail": ROOT / "objectives" / "opd_topk_tail.dsl",
         "opd_reverse_topk": ROOT / "examples" / "opd_reverse_topk.dsl"}


@pytest.mark.parametrize("host", REFUSED)
def test_each_host_refuses_a_vocabulary_sum_at_construction_by_name_with_why_in_its_terms(host):
    """Each host, constructed in its own interpreter (verl's in its venv, tests/test_verl.py), on
    each distillation objective it does not give: the refusal names π_v and why, in the host's terms.
    One interpreter a host for all its objectives (importing TRL or verl is most of the cost)."""
    verl = pathlib.Path(os.environ.get("VERL_VENV", ROOT / ".venv-verl")) / "bin" / "python"   # (test_verl's)
    python = str(verl) if host == "verl" else sys.executable
    code = f"import json\n{HOSTS[host][0]}\n" + "".join(
        f"try:\n    Host({str(FILES[name])!r})\nexcept ValueError as e:\n    print('said', json.dumps(str(e)))\n"
        "else:\n    print('said', json.dumps('not refused'))\n" for name in REFUSED[host])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    said = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("said ")]
    assert len(said) == len(REFUSED[host]), proc.stdout
    for name, message in zip(REFUSED[host], said):
        assert message.startswith(HOSTS[host][1].format(name)), (name, message)
