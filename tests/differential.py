"""The differential test's machinery, shared by tests/test_differential.py and
benchmarks/differential.py: run one objective on one batch on each loss path (float64, CPU) and
hold the loss and every gradient (log π, H, the support's log π) to the independent float64
reference (tests/reference_dual.py); shrink a disagreement to its smallest case.

Tolerance: both sides compute in float64 (ε = 2.2e-16) the same formula in another order, with
other transcendental functions (≤ 1 ulp each) and sums of at most 25 tokens: over an objective
of at most ~40 operations that is ~1e-13 of the largest term, with cancellation. An element
agrees within RTOL·|want| + ATOL·scale (scale: the largest finite |want| of that output, at least
1), 1e-9 of it: four orders of magnitude above that rounding, and far below any difference of
meaning (a tie's share 1/n, a wrong ddof's √(n/(n−1)), a dropped term). NaN agrees with NaN and
an infinity with the same infinity, nothing else. Where the reference's loss is not finite, only
the loss is compared: the gradient of an infinite or undefined loss has no value to hold a path to
(forward mode gives NaN where reverse mode gives ±inf or 0). A case the reference marks fragile (a
comparison decided by rounding) is not compared."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import numpy as np
import torch

import dsl
from adversarial_batches import batch as draw_batch
from random_objectives import G, objective
from reference_dual import reference
from openrlhf_drpo.core import Aggregation, CompiledLoss

RTOL, ATOL = 1e-9, 1e-9
OUTPUTS = ("loss", "logp", "H", "vocab")
PATHS = ("plain", "fused", "sync_free", "compiled")


@dataclass
class Disagreement:
    path: str
    output: str          # loss, logp, H, vocab, or error
    kind: str            # 'value', 'nan' (one side not finite where the other is), 'error: ...'
    got: object = None
    want: object = None

    def key(self):
        return (self.path, self.output, self.kind)


def tensors(b: dict) -> dict:
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in b.items() if isinstance(v, np.ndarray)}
    t["logp"].requires_grad_()
    t["H"].requires_grad_()
    t["vocab_logp"].requires_grad_()
    return t


def loss_fn(obj, path: str) -> CompiledLoss:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # (a group reduction position by position is warned of)
        fn = CompiledLoss(obj, fused=path != "plain", compile=path == "compiled")
    fn.sync_free = path == "sync_free"
    return fn


def run_path(obj, b: dict, path: str, fn: CompiledLoss | None = None) -> dict:
    """{loss, logp, H, vocab} on one path (a gradient the loss does not give: 0)."""
    fn = fn or loss_fn(obj, path)
    t = tensors(b)
    weights = None if b.get("weights") is None else t["weights"]
    loss, _ = fn(t["logp"], t["old"], t["A"], t["mask"], rollout_log_probs=t["rollout"], ref_log_probs=t["ref"],
                 entropy=t["H"], sum_pi_sq=t["sum_pi_sq"], groups=t["groups"], turns=t["turns"],
                 staleness=t["staleness"], vocab_log_probs=t["vocab_logp"], vocab_ref_log_probs=t["vocab_ref"],
                 aggregation=Aggregation(mode=b.get("mode"), norm=b.get("norm"), weights=weights))
    leaves = [t["logp"], t["H"], t["vocab_logp"]]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * 3
    out = {"loss": loss.detach().double().numpy()}
    for name, x, g in zip(OUTPUTS[1:], leaves, grads):
        out[name] = np.zeros(x.shape) if g is None else g.double().numpy()
    return out


def mismatch(got, want) -> str | None:
    """None where got agrees with want (the module docstring's rule); else 'nan' or 'value'."""
    got, want = np.asarray(got, dtype=float), np.asarray(want, dtype=float)
    fin_w, fin_g = np.isfinite(want), np.isfinite(got)
    same_nonfinite = (~fin_w & ~fin_g) & ((np.isnan(want) & np.isnan(got)) | (want == got))
    if ((fin_w != fin_g) | (~fin_w & ~same_nonfinite)).any():
        return "nan"
    if not fin_w.any():
        return None
    scale = max(1.0, float(np.abs(want[fin_w]).max()))
    err = np.abs(np.where(fin_w, got - want, 0.0))
    return "value" if (err > RTOL * np.abs(np.where(fin_w, want, 0.0)) + ATOL * scale).any() else None


def check(obj, b: dict, paths=PATHS[:3], mutation=None, fns: dict | None = None, want=None):
    """(the reference's result, the disagreements of each path; [] where it is fragile or undefined)."""
    want = want or reference(obj, b, mutation)
    if want["fragile"] or want["undefined"]:
        return want, []
    found = []
    for path in paths:
        try:
            got = run_path(obj, b, path, (fns or {}).get(path))
        except Exception as err:        # a refusal or a crash: a disagreement of its own kind
            found.append(Disagreement(path, "error", f"error: {type(err).__name__}", str(err)[:200]))
            continue
        for out in OUTPUTS if np.isfinite(want["loss"]) else OUTPUTS[:1]:
            kind = mismatch(got[out], want[out])
            if kind:
                found.append(Disagreement(path, out, kind, got[out], want[out]))
    return want, found


def item(seed: int, index: int, discards: dict | None = None):
    """Draw `index` of `seed`: (Spec, Objective, batch), each seeded by (seed, index) alone."""
    spec, obj = objective(seed, index, discards)
    return spec, obj, draw_batch(np.random.default_rng([seed, index]))


# ---------------------------------------------------------------- the shrinker
def _objective_candidates(spec):
    """Smaller specs: an option dropped, a binding inlined, a subtree replaced by one of its
    arguments or by a leaf (r, π, 1)."""
    for k in spec.options:
        yield replace(spec, options={o: v for o, v in spec.options.items() if o != k})
    for name, tree in spec.bindings.items():
        yield replace(spec, bindings={}, expr=_swap_leaf(spec.expr, name, tree))
    nodes = [g for g in spec.expr.nodes() if g.op is not None]
    for g in nodes:
        for a in list(g.args) + [G(None, text="r"), G(None, text="π"), G(None, text="1")]:
            if a.op is None and a.constant:
                continue
            yield replace(spec, expr=_replaced(spec.expr, g, a))
    for name, tree in spec.bindings.items():
        for g in [x for x in tree.nodes() if x.op is not None]:
            for a in g.args:
                yield replace(spec, bindings={name: _replaced(tree, g, a)})


def _replaced(root, old, new):
    if root is old:
        return new
    if root.op is None:
        return root
    return G(root.op, [_replaced(a, old, new) for a in root.args], root.text, root.brackets, root.constant)


def _swap_leaf(root, name, tree):
    if root.op is None:
        return tree if root.text == name else root
    return G(root.op, [_swap_leaf(a, name, tree) for a in root.args], root.text, root.brackets, root.constant)


def _batch_candidates(b):
    B, T = b["mask"].shape
    per_token = [k for k, v in b.items() if isinstance(v, np.ndarray) and v.shape[:2] == (B, T)]
    for i in range(B) if B > 1 else ():
        keep = np.arange(B) != i
        yield {**b, **{k: b[k][keep] for k in per_token}, "groups": b["groups"][keep]}
    for j in range(T) if T > 1 else ():
        keep = np.arange(T) != j
        yield {**b, **{k: b[k][:, keep] for k in per_token}}
    for k, simple in (("norm", None), ("weights", None), ("groups", np.zeros_like(b["groups"]))):
        if b.get(k) is not None and not (k == "groups" and not b[k].any()):
            yield {**b, k: simple}


def shrink(spec, b: dict, d: Disagreement, budget: int = 400):
    """The smallest (objective text, batch) found, greedily, on which the path still disagrees in the
    same output, the same way."""
    def fails(s, x):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = dsl.parse(s.text())
            _, found = check(obj, x, paths=(d.path,))
        except Exception:
            return False
        return any(f.key() == d.key() for f in found)
    tries, changed = 0, True
    while changed and tries < budget:
        changed = False
        for s in _objective_candidates(spec):
            tries += 1
            if len(s.text()) < len(spec.text()) and fails(s, b):
                spec, changed = s, True
                break
        for x in _batch_candidates(b):
            tries += 1
            if fails(spec, x):
                b, changed = x, True
                break
    return spec, b


def case_text(spec, b: dict) -> dict:
    """A minimized case as JSON: the objective's text and the batch's arrays (masked slots as given)."""
    def plain(v):
        return v.tolist() if isinstance(v, np.ndarray) else v
    return {"objective": spec.text(), "batch": {k: plain(v) for k, v in b.items() if v is not None}}
