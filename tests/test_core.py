"""The host-neutral loss core at its edges: the tensor boundary (shapes, devices, dtypes, the
mask), second derivatives, and torch.compile's caches in a process that builds many objectives."""
import warnings

import pytest
import torch
from extra_inputs import extra_inputs

import dsl
from openrlhf_drpo.core import loss as core_loss
from openrlhf_drpo.core import Aggregation, CompiledLoss


def _inputs(B=3, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    return logp.requires_grad_(), logp.detach() - 0.1 * torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)


LP, OLD, A = _inputs()
BAD_INPUTS = [
    ("per_response_advantages", dict(advantages=A[:, :1]),
     "CompiledLoss: advantages is [3, 1], log_probs [3, 5]: expand per-response advantages with "
     "advantages.expand_as(log_probs)"),
    ("flat_advantages", dict(advantages=A[:, 0]),
     "CompiledLoss: advantages is [3], log_probs [3, 5]: expand per-response advantages with "
     "advantages.unsqueeze(-1).expand_as(log_probs)"),
    ("short_old_log_probs", dict(old_log_probs=OLD[:, :4]),
     "CompiledLoss: old_log_probs is [3, 4], log_probs [3, 5]: every per-token input has log_probs' shape "
     "[batch, tokens]"),
    ("mask_of_another_shape", dict(mask=torch.ones(3, 4, dtype=torch.bool)),
     "CompiledLoss: mask is [3, 4], log_probs [3, 5]: every per-token input has log_probs' shape [batch, tokens]"),
    ("one_response_unbatched", dict(log_probs=LP[0], old_log_probs=OLD[0], advantages=A[0]),
     "CompiledLoss: log_probs is [5]: the loss takes [batch, tokens] (one response: log_probs.unsqueeze(0))"),
    ("integer_log_probs", dict(log_probs=LP.detach().long()),
     "CompiledLoss: log_probs is torch.int64: pass floating-point values (log_probs.float())"),
    ("integer_advantages", dict(advantages=A.sign().long()),
     "CompiledLoss: advantages is torch.int64: pass floating-point values (advantages.float())"),
    ("weighted_mask", dict(mask=torch.full((3, 5), 0.5)),
     "CompiledLoss: mask holds values other than 0 and 1 (0.5): it selects tokens (1 = a response token, "
     "0 = padding); pass per-token weights as Aggregation(weights=...), or (mask != 0) to keep every "
     "token whose entry is not 0"),
    ("mask_of_twos", dict(mask=torch.full((3, 5), 2)),
     "CompiledLoss: mask holds values other than 0 and 1 (2): it selects tokens (1 = a response token, "
     "0 = padding); pass per-token weights as Aggregation(weights=...), or (mask != 0) to keep every "
     "token whose entry is not 0"),
    ("advantages_as_a_list", dict(advantages=[1.0] * 5),
     "CompiledLoss: advantages must be a torch.Tensor of shape [3, 5], got list"),
    ("per_response_weights", dict(weights=torch.ones(3, 1)),
     "CompiledLoss: weights is [3, 1], log_probs [3, 5]: expand per-response weights with "
     "weights.expand_as(log_probs)"),
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case, change, message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_a_bad_tensor_is_refused_with_its_name_shape_and_fix(case, change, message, fused):
    args = {**dict(log_probs=LP, old_log_probs=OLD, advantages=A, mask=None, weights=None), **change}
    with pytest.raises(ValueError) as e:
        CompiledLoss("drpo", fused=fused)(args["log_probs"], args["old_log_probs"], args["advantages"], args["mask"],
                                          aggregation=Aggregation(weights=args["weights"]))
    assert str(e.value) == message


def test_a_tensor_on_another_device_is_refused_with_the_move_that_fixes_it():
    meta = torch.empty(3, 5, device="meta")      # a second device on any machine
    with pytest.raises(ValueError) as e:
        CompiledLoss("drpo")(LP, OLD, meta)
    assert str(e.value) == ("CompiledLoss: advantages is on meta, log_probs on cpu: move it with "
                            "advantages.to(log_probs.device)")


def test_the_openrlhf_adapter_names_the_mask_as_its_host_does():
    from openrlhf_drpo import ObjectiveLoss
    with pytest.raises(ValueError, match=r"^ObjectiveLoss: action_mask is \[3, 4\], log_probs \[3, 5\]"):
        ObjectiveLoss("drpo")(LP, OLD, A, action_mask=torch.ones(3, 4))


@pytest.mark.parametrize("mask", [torch.ones(3, 5, dtype=torch.bool), torch.ones(3, 5, dtype=torch.int64),
                                  torch.ones(3, 5), torch.ones(3, 5, dtype=torch.uint8)],
                         ids=["bool", "int64", "float32", "uint8"])
def test_masks_of_zeros_and_ones_in_any_dtype_give_the_same_loss(mask):
    mask = mask.clone()
    mask[0, 3:] = 0
    reference, _ = CompiledLoss("drpo")(LP, OLD, A, mask != 0)
    loss, _ = CompiledLoss("drpo")(LP, OLD, A, mask)
    assert torch.equal(loss, reference)


@pytest.mark.parametrize("sync_free", [False, True], ids=["eager", "sync_free"])
@pytest.mark.parametrize("name", ["drpo", "ppo", "gspo"])
def test_a_second_derivative_through_the_fused_loss_is_an_error_and_the_plain_path_gives_it(name, sync_free):
    logp, old, adv = _inputs(B=2, T=4, seed=1)
    loss_fn = CompiledLoss(name)
    loss_fn.sync_free = sync_free
    # beside another differentiable term, whose own second derivative alone would come back
    fused = loss_fn(logp, old, adv)[0] + logp.square().sum()
    (g,) = torch.autograd.grad(fused, logp, create_graph=False)        # once: fine
    with pytest.raises(RuntimeError, match="CompiledLoss: the fused loss is differentiable once; for "
                                           r"create_graph=True \(second derivatives\) build it with fused=False"):
        torch.autograd.grad(loss_fn(logp, old, adv)[0] + logp.square().sum(), logp, create_graph=True)
    # the plain path's Hessian-vector product equals the finite difference of its gradient
    plain = CompiledLoss(name, fused=False)
    logp64, old64, adv64 = (x.detach().double() for x in (logp, old, adv))
    v = torch.randn(logp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def grad_at(x, create_graph=False):
        x = x.clone().requires_grad_()
        return x, torch.autograd.grad(plain(x, old64, adv64)[0], x, create_graph=create_graph)[0]
    x, g = grad_at(logp64, create_graph=True)
    hvp = torch.autograd.grad((g * v).sum(), x)[0]
    h = 1e-6
    fd = (grad_at(logp64 + h * v)[1] - grad_at(logp64 - h * v)[1]) / (2 * h)
    assert torch.allclose(hvp, fd, rtol=1e-5, atol=1e-8), (hvp, fd)


@pytest.fixture
def counting_backend(monkeypatch):
    """torch.compile with a backend that records each graph it is given and each call of it:
    dynamo's own tracing and caching, without inductor's seconds of code generation."""
    graphs, runs = [], []

    def backend(gm, example_inputs):
        index = len(graphs)
        graphs.append(gm)

        def run(*args):
            runs.append(index)
            return gm.forward(*args)
        return run
    monkeypatch.setattr(core_loss, "COMPILE_OPTIONS", {"dynamic": True, "backend": backend})
    return graphs, runs


def test_every_objective_in_one_process_runs_compiled_and_a_new_length_adds_no_graph(counting_backend):
    graphs, runs = counting_backend
    names = [n for n in dsl.shipped_names() if not dsl.load(n).reads_rollout()][:12]
    assert len(names) == 12
    # each objective: the usual call, then one of a batch of 1, a given norm and given weights (all
    # three, over the objectives), then new sequence lengths; 24 forward graphs in all (and as many
    # backward ones), past a shared cache's 8, so that a kernel shared by the objectives would run
    # some of them uncompiled
    extras = [(1, 8, {}), (4, 8, {"norm": 7.0}), (4, 8, {"weights": torch.rand(4, 8)})]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="objective ")      # no fallback warning either
        for i, name in enumerate(names):
            loss_fn = CompiledLoss(name, compile=True)
            for B, T, kw in [(4, 8, {}), extras[i % 3], (4, 13, {}), (4, 21, {})]:
                before, compiled = len(runs), len(graphs)
                logp, old, adv = _inputs(B, T)
                loss_fn(logp, old, adv, aggregation=Aggregation(**kw), **extra_inputs(loss_fn, logp))[0].backward()
                # this call ran two compiled graphs: forward's and backward's
                assert len(runs) == before + 2 and runs[-2] != runs[-1], (name, B, T, kw)
                if T != 8:      # a new sequence length: the dynamic graphs take it
                    assert len(graphs) == compiled, (name, T)
    assert len(graphs) == 2 * 2 * len(names)


def test_a_kernel_past_dynamos_recompile_limit_warns_once_naming_the_objective_and_stays_exact(counting_backend):
    loss_fn, eager = CompiledLoss("spo", compile=True), CompiledLoss("spo", compile=False)
    with torch._dynamo.config.patch(recompile_limit=1), \
            pytest.warns(RuntimeWarning, match="objective 'spo': torch.compile reached its recompile limit") as seen:
        for B in (4, 1, 4, 1):        # a batch of 1 needs a second graph
            logp, old, adv = _inputs(B, 6)
            loss, _ = loss_fn(logp, old, adv)
            expected, _ = eager(logp, old, adv)
            assert torch.allclose(loss, expected, rtol=1e-6)
    assert len([w for w in seen if "recompile limit" in str(w.message)]) == 1


class HostReads(torch.overrides.TorchFunctionMode):
    """Records what would make the host wait for a CUDA device, on any device: reading a value
    (.item(), .tolist(), bool(), int(), float(), .numpy()), and, below it (SyncOps), the ops that
    do (_local_scalar_dense), whose output size depends on the data (nonzero, masked_select, ...),
    or that copy a Python value onto the device (lift_fresh: torch.tensor / as_tensor of a number).
    One read is one entry: the ops torch runs below a read it records are not counted again."""
    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"}

    def __init__(self):
        super().__init__()
        self.seen, self.depth = [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        read = getattr(func, "__name__", "") in self.READS
        if read:
            self.seen.append(func.__name__)
        self.depth += read
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.depth -= read


class SyncOps(torch.utils._python_dispatch.TorchDispatchMode):
    OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "lift_fresh", "repeat_interleave"}

    def __init__(self, reads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] in self.OPS and not self.reads.depth:
            self.reads.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def host_syncs(loss_fn, logp, old, adv, mask, **kw):
    """What forward and backward of loss_fn did that would sync with a CUDA host."""
    with HostReads() as reads, SyncOps(reads):
        loss, metrics = loss_fn(logp, old, adv, mask, rollout_log_probs=old - 0.1, **kw)
        loss.backward()
        metrics.logged()        # views: still tensors
    return reads.seen


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("name", dsl.shipped_names())
def test_no_path_syncs_with_the_host_on_the_path_cuda_takes(name, fused):
    """Every shipped objective, fused (the kernels CUDA runs, uncompiled) or plain, with a global
    normalizer and host weights: nothing reads a value on the host, and the metrics stay tensors.
    A bool mask: a mask of other dtypes is also checked for 0 and 1, in the kernel's pass, read on
    the CPU, an asynchronous device assert on CUDA (boundary.refuse_bad_mask)."""
    logp, old, adv = _inputs(B=3, T=7)
    mask = torch.rand(3, 7, generator=torch.Generator().manual_seed(3)) > 0.3
    loss_fn = CompiledLoss(name, fused=fused)
    loss_fn.sync_free = True
    for agg in (Aggregation(), Aggregation(norm=9.0, weights=torch.rand(3, 7))):
        assert host_syncs(loss_fn, logp, old, adv, mask, aggregation=agg, **extra_inputs(loss_fn, logp)) == [], agg


def test_the_cpu_eager_kernel_reads_its_metrics_in_one_sync_and_the_recorder_sees_it():
    """The recorder above sees a sync where there is one: the CPU's default eager kernel (a measured
    CPU speed-up) reads its metrics' sums in one sync a call, at most one and at least one. grpo_k3
    never reads a clamped ratio: its generated code has no branch on the clamp, which reads more.
    (lift_fresh, a copy of the metrics onto the device, is no read.)"""
    logp, old, adv = _inputs(B=3, T=7)
    loss_fn = CompiledLoss("grpo_k3")
    seen = host_syncs(loss_fn, logp, old, adv, torch.ones(3, 7, dtype=torch.bool), **extra_inputs(loss_fn, logp))
    assert len([s for s in seen if "lift_fresh" not in s]) == 1, seen


def test_the_sync_free_kernels_refuse_a_mask_that_is_not_zero_or_one_as_the_boundary_does():
    logp, old, adv = _inputs()
    loss_fn = CompiledLoss("drpo")
    loss_fn.sync_free = True
    with pytest.raises(ValueError, match=r"^CompiledLoss: mask holds values other than 0 and 1 \(0\.5\): it selects"):
        loss_fn(logp, old, adv, torch.full((3, 5), 0.5))
    assert loss_fn(logp, old, adv, torch.ones(3, 5))[0].isfinite()
