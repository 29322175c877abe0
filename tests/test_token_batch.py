"""The loss core's two values: a call's tensors as one TokenBatch, built and checked once at the
tensor boundary and handed whole to the generated code on every path; and a compiled objective as
one Generated record, whose fields are every fact the loss core reads about its functions."""
import ast
import dataclasses
import pathlib
import re

import pytest
import torch
from extra_inputs import extra_inputs
from test_core import BAD_INPUTS, LP, OLD, A

import dsl
from openrlhf_drpo.core import loss as core_loss
from openrlhf_drpo.core import batch as core_batch
from openrlhf_drpo.core import Aggregation, CompiledLoss, Generated, TokenBatch
from openrlhf_drpo.core.codegen import compile_objective

CORE = pathlib.Path(core_loss.__file__).parent
SHIPPED = dsl.shipped_names()
FIELDS = {f.name for f in dataclasses.fields(Generated)}
BATCH = {f.name for f in dataclasses.fields(TokenBatch)}


@pytest.mark.parametrize("case, change, message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_a_token_batch_built_from_a_bad_tensor_is_refused_naming_the_tensor_its_shape_and_the_fix(case, change,
                                                                                                  message):
    args = {**dict(log_probs=LP, old_log_probs=OLD, advantages=A, mask=None, weights=None), **change}
    with pytest.raises(ValueError) as e:
        CompiledLoss("drpo").batch(args["log_probs"], args["old_log_probs"], args["advantages"], args["mask"],
                                   aggregation=Aggregation(weights=args["weights"]))
    assert str(e.value) == message       # forward's own message (test_core), raised where the batch is built


# an objective of each kind: the eager kernel's flat code, the raw ratio, a filter, a sequence
# reduction, the third version (H, π_ref, a group and a batch reduction)
KINDS = ["drpo", "gspo", "icepop", "topr_seq", "entropy_bonus", "grpo_k3", "trust_the_batch", "oapl"]


@pytest.mark.parametrize("path", ["eager", "sync_free", "plain"])
@pytest.mark.parametrize("name", KINDS)
def test_every_path_hands_the_generated_code_the_one_token_batch_the_call_built(name, path, monkeypatch):
    """On every path each generated function (the filter's, the lab's second evaluation too)
    receives a TokenBatch derived from the one forward built and checked, its tensors of log π's
    shape (or, in the eager kernel's flat code, its flat view): nothing is checked twice or skipped."""
    loss_fn = CompiledLoss(name, fused=path != "plain")
    loss_fn.sync_free, loss_fn.track_extremes = path == "sync_free", True
    seen, built = [], []

    def spy(fn):
        return None if fn is None else lambda b, *rest: seen.append(b) or fn(b, *rest)
    g = loss_fn.generated
    loss_fn.generated = dataclasses.replace(g, **{k: spy(getattr(g, k)) for k in
                                                  ("value", "value_and_grad", "value_and_grad_eager", "filtered")})
    checks, check = [], core_batch.check_inputs
    monkeypatch.setattr(core_batch, "check_inputs", lambda *a, **k: checks.append(a) or check(*a, **k))
    build = loss_fn.batch
    monkeypatch.setattr(loss_fn, "batch", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    logp = LP.detach().clone().requires_grad_()
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    extra = extra_inputs(loss_fn, logp)
    loss_fn(logp, OLD, A, mask, rollout_log_probs=OLD - 0.01, **extra)[0].backward()
    assert len(built) == len(checks) == 1 and isinstance(built[0], TokenBatch)
    assert seen and all(type(b) is TokenBatch for b in seen), [type(b) for b in seen]
    for b in seen:
        assert b.mode == built[0].mode and b.mask.shape == logp.shape
        for field in ("logp", "anchor", "A", "old", "rollout", "ref", "entropy", "sum_pi_sq"):
            x = getattr(b, field)
            assert x is None or x.shape in (logp.shape, (logp.numel(),)), (field, x.shape)
            assert (x is None) == (getattr(built[0], field) is None), field


@pytest.mark.parametrize("name", SHIPPED)
def test_a_compiled_objective_is_one_frozen_record_and_no_function_carries_a_fact(name):
    generated = compile_objective(dsl.load(name))
    assert type(generated) is Generated
    with pytest.raises(dataclasses.FrozenInstanceError):
        generated.reduces = True
    for field in ("value", "value_and_grad", "value_and_grad_eager", "filtered"):
        fn = getattr(generated, field)
        assert fn is None or vars(fn) == {}, (field, vars(fn))     # a fact set on a function object
    for fact in ("includes_coef", "reduces", "third_version", "filtered_per_response"):
        assert type(getattr(generated, fact)) is bool, fact
    # the generated code reads its inputs from the batch's fields, and only those
    read = set(re.findall(r"\bb\.(\w+)", generated.source))
    assert {"logp", "anchor", "A"} <= read <= BATCH, read


def _reads(tree):
    """(line, what) for each fact the module reads off a generated objective or a batch: an
    attribute of a name `generated`/`b` (or of `.generated`), and every getattr with a default."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) == 3:
            yield node.lineno, f"getattr(..., {ast.unparse(node.args[1])}, default)"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
            owner = getattr(node.value, "id", None) or getattr(node.value, "attr", None)
            if owner == "generated" and node.attr not in FIELDS:
                yield node.lineno, f"generated.{node.attr}"
            elif owner == "b" and isinstance(node.value, ast.Name) and node.attr not in BATCH | set(dir(TokenBatch)):
                yield node.lineno, f"b.{node.attr}"


@pytest.mark.parametrize("module", sorted(p.name for p in CORE.glob("*.py")))
def test_the_loss_core_reads_every_fact_from_the_record_never_from_a_function_object(module):
    """A fact a kernel reads with getattr(fn, name, default) is silent where the record lacks it:
    every fact the core reads is a field of Generated (or of TokenBatch), so a missing one fails here."""
    path = CORE / module
    found = [f"{path.name}:{line}: {what}" for line, what in _reads(ast.parse(path.read_text(encoding="utf-8")))]
    assert not found, found
