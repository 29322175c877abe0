"""IR -> torch source. The same IR and the same derivative rules as the analysis.

Three functions are generated per objective, each reading its tensors from `b`, a TokenBatch:
  objective(b, m) -> ℓ per token (autograd differentiates it: the plain path)
  objective_and_grad(b, m, coef) -> (ℓ, ∂ℓ/∂log π, r, log π − log μ, μ, keep) in one pass (the fused
      path; the rest for the loss's metrics); objective_and_grad_eager(b): the same, for eager CPU
Inputs: b.logp = log π, b.anchor = log μ, b.A = advantages, b.old and b.rollout the trainer's and
the engine's log-probs (None where unused), m the bool mask, coef each token's aggregation weight,
all [B, T]. compile_objective returns them as one record (values.Generated) with their facts.
r = exp(clamp(logp - anchor, -20, 20)), as OpenRLHF and verl compute the ratio.

A reduction (seq_mean, prefix_sum, group_mean, ...) of the policy makes a token's gradient depend
on other tokens. Then objective_and_grad is derived in reverse mode from the same rules, and its
gradient is that of Σ coef·ℓ (`includes_coef`); the eager function is the same one. An objective
of the third version (dsl.levels.third_version: its inputs b.ref, ...) always takes it, and one
that reads H also returns d(Σ coef·ℓ)/dH, H's own gradient channel."""
from __future__ import annotations

import functools
import re

from dsl.ir import ONE, Node, mul, var
from dsl.operations import OPS, REDUCTIONS
from dsl.parser import Objective
from dsl.printing import render
from openrlhf_drpo.core.kernel_table import KERNELS
from openrlhf_drpo.core.reverse_mode import forward_gradient, nesting, reverse_gradient
from openrlhf_drpo.core.rewrites import annotate_levels, filters, guard_autograd, guard_selects, rewrite_logs, select_masks
from openrlhf_drpo.core.values import Generated
from dsl.walks import NonLocal, constant_nodes, derivative, evaluate, reads_whole_response

CLAMP = 20.0


# d/d(log π) of each leaf: the ratio's clamp passes gradient only where it is inactive
# (`keep`), exactly as autograd through torch.clamp does; dr = r·keep. Where no ratio is
# clamped (the eager kernel checks), dr = r and keep = 1: ℓ and ∂ℓ/∂log π then share r·A.
# The clamp selects (a seed select(c, s): reverse_mode), so an infinite derivative above it meets no 0.
_KEPT = Node("gt", (var("keep"), Node("num", value=0)))
GRAD_SEEDS = {"r": Node("select", (_KEPT, var("r"))), "pi": var("pi"), "logp": Node("num", value=1),
              "log_ratio": Node("select", (_KEPT, Node("num", value=1)))}
CHANNELS = {"entropy": {"H": ONE}, "vocab_logp": {"pi_v": var("pi_v"), "lv": ONE}}   # Generated.channels' seeds
UNCLAMPED_SEEDS = {**GRAD_SEEDS, "r": var("r"), "log_ratio": Node("num", value=1)}


class _Emitter:
    """Emits statements with common-subexpression elimination: a subtree used twice gets
    a name; constant subtrees are folded to a float (parameters are listed in the header).
    With `inplace`, an op whose argument is a fresh temporary (an unnamed op result) updates
    it in place: the fused function runs without autograd, and on CPU each fresh 1 MB
    tensor costs page faults. Every tensor in it has the inputs' shape, so none broadcasts.
    With `floats`, booleans are 0/1 float tensors (each op's `floats` lowering)."""

    def __init__(self, params, outputs, inplace=False, floats=False):
        self.params = params
        self.constant = constant_nodes(*outputs)
        self.inplace = inplace
        self.floats = floats
        self.lines: list[str] = []
        self.names: dict[Node, str] = {}
        self.owned: set[str] = set()       # named temporaries that own their storage
        self.uses: dict[Node, int] = {}

    def count(self, n: Node):
        self.uses[n] = self.uses.get(n, 0) + 1
        if self.uses[n] == 1 and n not in self.constant:
            for a in n.args:
                self.count(a)
                if KERNELS[n.op].reuses_args:   # torch.where(a <= b, a, b) evaluates a and b once
                    self.count(a)

    def expr(self, n: Node) -> tuple[str, bool]:
        """(source, whether it is a fresh temporary that no other code reads)."""
        if n in self.names:
            return self.names[n], False
        if n in self.constant:
            v = evaluate(n, self.params)
            if OPS.get(n.op) and OPS[n.op].kind == "bool":
                return repr(float(bool(v)) if self.floats else bool(v)), False
            return repr(float(v)), False
        if n.op == "var":
            return n.value, False
        op, kernel = OPS[n.op], KERNELS[n.op]
        args = [self.expr(a) for a in n.args]
        codes = [c for c, _ in args]
        fresh = op.kind == "num" and not kernel.view       # comparisons give bool
        if self.floats and kernel.floats:
            code, fresh = kernel.floats(*args)
        elif self.inplace and kernel.inplace and args[0][1]:
            code = f"{codes[0]}.{kernel.inplace}({', '.join(codes[1:])})"
        elif self.inplace and kernel.inplace_second and args[1][1]:
            code = kernel.inplace_second(*codes)
        else:       # a group or batch reduction's text also takes its argument's level (Node.level)
            code = op.torch(*codes) if n.level is None else op.torch(*codes, n.level)
        if self.uses.get(n, 0) > 1 and n.args:
            name = f"t{len(self.names)}"
            self.lines.append(f"    {name} = {code}  # {render(n)}")
            self.names[n] = name
            if fresh:
                self.owned.add(name)
            return name, False
        return code, fresh


_INPUTS = {"logp", "anchor", "A", "old", "rollout"}


def _emit(outputs, params, inplace=False, floats=False, borrow=()):
    """(statements, one expression per output) computing `outputs`. With `inplace`, each
    returned tensor is a buffer of its own, except that the outputs numbered in `borrow` may be
    an input itself (the caller only reads those: no copy)."""
    em = _Emitter({k: float(v) for k, v in params.items()}, outputs, inplace, floats)
    for n in outputs:
        em.count(n)
    results = []
    for i, n in enumerate(outputs):
        code, fresh = em.expr(n)
        if n in em.constant:      # a constant output (e.g. ∂ℓ/∂log π ≡ 0 somewhere) still has the inputs' shape
            code = f"torch.full_like(logp, {code})"
        elif inplace and code in em.owned:      # returned once as it is, then copied
            em.owned.discard(code)
        elif inplace and i in borrow and code in _INPUTS:
            pass
        elif inplace and not fresh:   # the caller may overwrite every returned tensor
            code = f"{code}.clone()"
        results.append(code)
    return em.lines, results


def _used(nodes, extra=()) -> set:
    """The names read: built-ins, `group`/`pg`/`turns` for a group/batch/turn reduction (representatives,
    process group, turn ids)."""
    used = {m.value for n in nodes for m in n.walk() if m.op == "var"} | set(extra)
    used |= {{"group": "group", "batch": "pg", "turn": "turns"}[OPS[m.op].over] for n in nodes for m in n.walk()
             if m.op in OPS and OPS[m.op].over in ("group", "batch", "turn")} | set(["turns"] * ("turn_len" in used))
    return used | ({"r", "keep"} if "dr" in used else set())


# the policies' log-probs and the third and fourth versions' inputs (the support's k first), read where used:
# (the generated code's name, the batch's field, the name of its exp or "")
_FROM_BATCH = (("old", "old", "pi_old"), ("rollout", "rollout", "pi_rollout"), ("ref", "ref", "pi_ref"),
               ("H", "entropy", ""), ("sum_pi_sq", "sum_pi_sq", ""), ("group", "group", ""), ("pg", "pg", ""),
               ("turns", "turns", ""), ("staleness", "staleness", ""),
               ("lv", "vocab_logp.movedim(-1, 0)", "pi_v"), ("lref", "vocab_ref.movedim(-1, 0)", "pi_ref_v"))


def _prelude(used, unclamped=False) -> list[str]:
    """Only the built-ins the expressions use are computed (raw = logp − anchor comes first)."""
    out = []
    if unclamped:
        out += ["    log_ratio = raw"] * bool(used & {"log_ratio"}) + ["    r = torch.exp(raw)"] * ("r" in used)
    else:
        if used & {"r", "log_ratio", "keep"}:
            out.append(f"    log_ratio = torch.clamp(raw, -{CLAMP}, {CLAMP})")
        if "r" in used:
            out.append("    r = torch.exp(log_ratio)")
        if "keep" in used:
            # d clamp(raw)/d raw: 1 where the clamp is inactive, else 0, by float ops in place
            # (several times faster than comparisons on CPU)
            out.append("    keep = (raw - log_ratio).sign_().abs_().neg_().add_(1.0)")
        if "dr" in used:
            out.append("    dr = r * keep")
    out += ["    pi = torch.exp(logp)"] * ("pi" in used) + ["    mu = torch.exp(anchor)"] * ("mu" in used)
    for name, field, exp in _FROM_BATCH:
        out += [f"    {name} = b.{field}"] * bool(used & {name, exp}) + [f"    {exp} = torch.exp({name})"] * (exp in used)
    out += ["    seq_len = m.sum(-1, keepdim=True).to(dtype).expand_as(logp)"] * ("seq_len" in used)
    out += ["    turn_len = _turn_len(m, logp, turns)"] * ("turn_len" in used) + ["    mf = m.to(dtype)"] * ("mf" in used)
    return out


def _tuple(codes) -> str:
    return codes[0] if len(codes) == 1 else "(" + ", ".join(codes) + ")"


def function_source(name, doc, outputs, params) -> str:
    used = _used(outputs)
    head = _HEAD[:2] + _HEAD[2:] * bool(used & {"r", "log_ratio", "raw", "keep"})
    lines, results = _emit(outputs, params)
    return "\n".join([f"def {name}(b, m=None):", f'    """{doc}"""'] + head + _prelude(used) + lines
                     + [f"    return {_tuple(results)}"])


def _reads_clamped_ratio(value: Node) -> bool:
    """Whether the objective reads r or log(r), which are clamped. One that does not (GSPO,
    GMPO: log π − log μ) has no numerical stop at |log r| = 20: the metrics' keep is 1 (a zero
    gradient there is the objective's own, a boundary), and their r (in w = (∂ℓ/∂log π)/(r·A),
    the largest ratio, |π − μ|) is the unclamped exp(log π − log μ)."""
    return bool(_used([value]) & {"r", "log_ratio"})


def _fused_functions(value, params, kept) -> str:
    """objective_and_grad (for torch.compile) and objective_and_grad_eager (run eagerly: booleans
    as floats, and a branch on the data, which a compiled graph should not have)."""
    extra = ("r", "raw", "mu", "keep")
    head = _HEAD
    grad = select_masks(forward_gradient(value, GRAD_SEEDS))     # [c]·dx selects: min's other branch may be inf
    outputs = [value, grad] + [kept] * (kept is not None)
    raw_only = not _reads_clamped_ratio(value)

    def returned(results, keep="1.0" if raw_only else "keep"):   # 0 where the ratio clamp is active or a filter drops
        if kept is None:
            return _tuple(results + [*extra[:-1], keep])
        return _tuple(results[:2] + [*extra[:-1], results[2] if keep == "1.0" else f"{keep} * {results[2]}"])
    lines, results = _emit(outputs, params, inplace=True)
    compiled = [*head, *_prelude(_used(outputs, extra), raw_only), *lines, f"    return {returned(results)}"]
    fast_grad = select_masks(derivative(value, UNCLAMPED_SEEDS))
    fast_outputs = [value, fast_grad] + [kept] * (kept is not None)
    # the eager kernel only reads ∂ℓ/∂log π (GPG's is A itself: a copy would cost more than its loss)
    fast_lines, fast_results = _emit(fast_outputs, params, inplace=True, floats=True, borrow=(1,))
    fast = [*_prelude(_used(fast_outputs, extra[:-1]), unclamped=True), *fast_lines,
            f"    return {returned(fast_results, '1.0')}"]
    lines, results = _emit(outputs, params, inplace=True, floats=True, borrow=(1,))
    clamped = [*_prelude(_used(outputs, extra), raw_only), *lines, f"    return {returned(results)}"]
    # the branch only where the two differ (an objective that never reads the clamped ratio,
    # as GPG, takes the same code either way: no pass over raw, no host sync)
    eager = [*head, *clamped] if clamped == fast else [
        *head,
        "    lo, hi = torch.aminmax(raw)   # (a non-empty batch)",
        f"    if -{CLAMP} <= lo.item() and hi.item() <= {CLAMP}:   # no ratio is clamped: dr = r, keep = 1",
        *("    " + line for line in fast), *clamped]
    doc = ("ℓ and ∂ℓ/∂log π in one pass, sharing subexpressions (the fused path); r, the\n"
           "    unclamped log-ratio, μ and keep (0 where the ratio clamp is active or a filter drops\n"
           "    the token) come back too, for the loss's metrics. Each returned tensor is a buffer of\n"
           "    its own that the caller may overwrite, except keep.")
    eager_doc = ("objective_and_grad, run eagerly (CPU): booleans are 0/1 floats (a comparison into\n"
                 "    a float tensor is ~4x faster than into bool), and the usual batch, where no ratio\n"
                 "    is clamped, takes a branch where ℓ and ∂ℓ/∂log π share their products (where\n"
                 "    that code differs).\n"
                 "    ∂ℓ/∂log π may be an input itself (the caller only reads it).")
    return "\n".join([
        f"def objective_and_grad({_SIG}):", f'    """{doc}"""', *compiled, "", "",
        f"def objective_and_grad_eager({_SIG}):", f'    """{eager_doc}"""', *eager])


_SIG = "b, m=None, coef=None"
_HEAD = ["    logp, anchor, A = b.logp, b.anchor, b.A", "    dtype = logp.dtype", "    raw = logp - anchor"]


def _reverse_functions(value, params, kept, per_response, channels=()) -> str:
    """objective_and_grad for an objective with a reduction of the policy or an input of the
    third version: its gradient is that of Σ coef·ℓ, computed plainly (no in-place updates:
    reductions broadcast); then its gradient with respect to each of `channels` (CHANNELS: H, the support's)."""
    # with a reduction of the policy, raw comes back as its response's mean: the move's direction
    # is the response's (its masked mean over tokens is unchanged, so ppo_kl is too)
    extra = ("r", "_seq_mean(raw, m, logp)" if per_response else "raw", "mu", "keep")
    grads = [reverse_gradient(value, seeds) for seeds in (GRAD_SEEDS, *(CHANNELS[c] for c in channels))]
    lines, results = _emit([value, *grads] + [kept] * (kept is not None), params)
    used = _used([value, *grads], ("r", "raw", "mu", "keep") + ("lv",) * ("vocab_logp" in channels))
    raw_only = not _reads_clamped_ratio(value)
    if kept is not None:
        results, extra = results[:-1], (*extra[:-1], results[-1] if raw_only else f"keep * {results[-1]}")
    else:
        extra = (*extra[:-1], "1.0" if raw_only else "keep")
    shaped = [f"torch.broadcast_to({c}, logp.shape)" for c in results]
    if "vocab_logp" in channels:       # the support's, last, in the batch's layout [B, T, k]
        shaped[-1] = f"torch.broadcast_to({results[-1]}, lv.shape).movedim(0, -1)"
    doc = ("ℓ and d(Σ coef·ℓ)/d(log π) (the aggregation weight coef is inside: a reduction\n"
           "    spreads each token's gradient over the tokens it reads), r, the log-ratio (the response's\n"
           "    mean where a reduction reads the policy), μ, keep; with H, d(Σ coef·ℓ)/dH last.")
    return "\n".join([
        f"def objective_and_grad({_SIG}):", f'    """{doc}"""', *_HEAD, *_prelude(used, raw_only), *lines,
        f"    return {_tuple(shaped[:2] + list(extra) + shaped[2:])}", "", "",
        "objective_and_grad_eager = objective_and_grad   # reductions: no eager specialization"])


def torch_source(obj: Objective) -> str:
    """Readable, commented torch code for the objective: exactly what ObjectiveLoss runs."""
    return _generate(obj)[0]


def _generate(obj: Objective) -> tuple[str, dict]:
    """(torch_source, the facts Generated holds about its functions)."""
    value = select_masks(rewrite_logs(annotate_levels(obj.expr, obj.facts.level)))
    found = filters(value)
    kept = functools.reduce(mul, found) if found else None     # 1 where a token survives every filter
    channels = ("entropy",) * ("H" in obj.names()) + ("vocab_logp",) * ("pi_v" in obj.names())   # (reverse mode's)
    v3 = obj.facts.third_version
    try:
        derivative(value, GRAD_SEEDS)
        nonlocal_ = False
    except NonLocal:
        nonlocal_ = True
    if nonlocal_ or v3:
        fused = _reverse_functions(guard_selects(value), obj.params, kept, nonlocal_, channels)   # (as autograd's)
    else:
        fused = _fused_functions(value, obj.params, kept)
    reduces = any(map(reads_whole_response, value.walk()))
    # reduces: the eager kernel flattens tokens, which a response's reduction (or a third version's input) cannot take
    facts = {"includes_coef": nonlocal_ or v3, "reduces": reduces or v3, "third_version": v3,
             "filtered_per_response": any(reads_whole_response(n) for f in found for n in f.walk()),
             "channels": channels, "batch_depth": 0}
    if v3:      # how deeply batch sums nest in all the code computes: BatchStatistics' no-grad passes
        g = guard_selects(value)
        facts["batch_depth"] = nesting("batch", g, *[reverse_gradient(g, s) for s in [GRAD_SEEDS, *map(CHANNELS.get, channels)]],
                                       *[kept] * (kept is not None))
    params = ", ".join(f"{k} = {float(v):g}" for k, v in obj.params.items()) or "none"
    header = [f"# objective {obj.name} ({obj.path}), maximized: {render(obj.expr)}",
        f"# parameters: {params}; @anchor = {obj.options['anchor']}; @aggregate = {obj.options['aggregate']}",
        "# b: the call's TokenBatch: logp = log π (current policy), anchor = log μ, A = advantages, b.old/b.rollout",
        "# = log π_old/log π_rollout; m = the mask (reductions read only its tokens), coef = the aggregation weight;",
        f"# all [batch, tokens]. r = exp(clamp(logp - anchor, ±{CLAMP:g})) as in OpenRLHF; constants are folded.",
        "# the third version's inputs: b.ref = log π_ref, b.entropy = H, b.sum_pi_sq, b.group (each response's group's"
        "\n# first response) and b.pg (the batch's process group, or None)" if v3 else None,
        "# the fourth version's: b.turns (turn ids), b.staleness" if _used([obj.expr]) & {"turns", "staleness"} else None,
        "import torch"]
    body = "\n".join([
        function_source("objective", "Per-token objective ℓ (autograd differentiates this: the plain path).",
                  [guard_autograd(guard_selects(value))], obj.params),     # a dropped branch's gradient is 0, not 0·NaN
        "", "", fused, "", "",
        function_source("filtered", "1 where the objective's filters drop the token (is_filter_ratio), else 0.",
                  [Node("sub", (ONE, kept))], obj.params) if kept is not None
        else "# (no filter: the objective has no [...] factor not involving π)",
    ]) + "\n"
    return "\n".join([h for h in header if h is not None] + reductions_import(body) + ["", "", ""]) + body, facts


def reductions_import(body: str) -> list[str]:     # the core.reductions functions `body` calls, imported
    called = sorted(set(re.findall(r"\b_([a-z_]+)\(", body)) & {*REDUCTIONS, "turn_len"})
    return [f"from openrlhf_drpo.core.reductions import {', '.join(f'{k} as _{k}' for k in called)}"] * bool(called)


def compile_objective(obj: Objective) -> Generated:
    """The objective's generated functions as callables, with their facts, in one record."""
    import torch
    source, facts = _generate(obj)
    exec(compile(source, f"<objective {obj.name}>", "exec"), namespace := {"torch": torch})
    return Generated(namespace["objective"], namespace["objective_and_grad"], namespace["objective_and_grad_eager"],
                     namespace.get("filtered"), source, **facts)
