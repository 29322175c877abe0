"""IR -> torch source. The same IR and the same derivative rules as the analysis.

Two functions are generated per objective:
  objective(logp, anchor, A)          -> ℓ per token (autograd differentiates it: the plain path)
  objective_and_grad(logp, anchor, A) -> (ℓ, ∂ℓ/∂log π) in one pass (the fused path)
Inputs: logp = log π (current policy), anchor = log μ, A = advantages, all [B, T].
r = exp(clamp(logp - anchor, -20, 20)), as OpenRLHF and verl compute the ratio.
"""
from __future__ import annotations

from .ir import OPS, Node, derivative, evaluate, render
from .parser import Objective

CLAMP = 20.0
_ZERO = Node("num", value=0)


def _var(name):
    return Node("var", value=name)


# log of a built-in probability is emitted as the log-prob itself: exact for tiny π
# (no exp/log round trip) and its derivative needs no division by π.
_LOG_ATOMS = {"pi": "logp", "r": "log_ratio", "mu": "anchor"}


def _rewrite_logs(n: Node) -> Node:
    if n.op == "log" and n.args[0].op == "var" and n.args[0].value in _LOG_ATOMS:
        return _var(_LOG_ATOMS[n.args[0].value])
    if not n.args:
        return n
    return Node(n.op, tuple(_rewrite_logs(a) for a in n.args), n.value)


# d/d(log π) of each leaf: the ratio's clamp passes gradient only where it is inactive
# (`keep`), exactly as autograd through torch.clamp does.
GRAD_SEEDS = {
    "r": Node("mul", (_var("r"), _var("keep"))), "pi": _var("pi"), "logp": Node("num", value=1),
    "log_ratio": _var("keep"),
}


def _constant(n: Node) -> bool:
    return all(m.op != "var" for m in n.walk())


class _Emitter:
    """Emits statements with common-subexpression elimination: a subtree used twice gets
    a name; constant subtrees are folded to a float (parameters are listed in the header)."""

    def __init__(self, params):
        self.params = params
        self.lines: list[str] = []
        self.names: dict[Node, str] = {}
        self.uses: dict[Node, int] = {}

    def count(self, n: Node):
        self.uses[n] = self.uses.get(n, 0) + 1
        if self.uses[n] == 1 and not _constant(n):
            for a in n.args:
                self.count(a)
                if OPS[n.op].reuses_args:   # torch.where(a <= b, a, b) evaluates a and b once
                    self.count(a)

    def expr(self, n: Node) -> str:
        if n in self.names:
            return self.names[n]
        if _constant(n):
            v = evaluate(n, self.params)
            return repr(bool(v)) if OPS.get(n.op) and OPS[n.op].kind == "bool" else repr(float(v))
        if n.op == "var":
            return n.value
        code = OPS[n.op].torch(*(self.expr(a) for a in n.args))
        if self.uses.get(n, 0) > 1 and n.args:
            name = f"t{len(self.names)}"
            self.lines.append(f"    {name} = {code}  # {render(n)}")
            self.names[n] = name
            return name
        return code


def _prelude(nodes) -> list[str]:
    """Only the built-ins the expressions use are computed."""
    used = {m.value for n in nodes for m in n.walk() if m.op == "var"}
    out = ["    dtype = logp.dtype"]
    if used & {"r", "log_ratio", "keep"}:
        out.append("    raw = logp - anchor")
        out.append(f"    log_ratio = torch.clamp(raw, -{CLAMP}, {CLAMP})")
    if "keep" in used:
        out.append(f"    keep = ((raw >= -{CLAMP}) & (raw <= {CLAMP})).to(dtype)")
    if "r" in used:
        out.append("    r = torch.exp(log_ratio)")
    if "pi" in used:
        out.append("    pi = torch.exp(logp)")
    if "mu" in used:
        out.append("    mu = torch.exp(anchor)")
    return out


def _function(name, doc, outputs, params) -> str:
    em = _Emitter({k: float(v) for k, v in params.items()})
    for n in outputs:
        em.count(n)
    results = [em.expr(n) for n in outputs]
    body = _prelude(outputs) + em.lines
    # a constant output (e.g. ∂ℓ/∂log π ≡ 0 somewhere) still has the inputs' shape
    results = [f"torch.full_like(logp, {res})" if _constant(n) else res for n, res in zip(outputs, results)]
    ret = results[0] if len(results) == 1 else "(" + ", ".join(results) + ")"
    return "\n".join([f"def {name}(logp, anchor, A):", f'    """{doc}"""'] + body + [f"    return {ret}"])


def torch_source(obj: Objective) -> str:
    """Readable, commented torch code for the objective: exactly what ObjectiveLoss runs."""
    value = _rewrite_logs(obj.expr)
    grad = derivative(value, GRAD_SEEDS)
    params = ", ".join(f"{k} = {float(v):g}" for k, v in obj.params.items()) or "none"
    header = [
        f"# objective {obj.name} ({obj.path}), maximized: {render(obj.expr)}",
        f"# parameters: {params}; @anchor = {obj.options['anchor']}; @aggregate = {obj.options['aggregate']}",
        "# logp = log π (current policy), anchor = log μ, A = advantages; all [batch, tokens].",
        f"# r = exp(clamp(logp - anchor, ±{CLAMP:g})) as in OpenRLHF; constants are folded.",
        "import torch",
        "",
        "",
    ]
    return "\n".join(header) + "\n".join([
        _function("objective", "Per-token objective ℓ (autograd differentiates this: the plain path).",
                  [value], obj.params),
        "",
        "",
        _function("objective_and_grad",
                  "ℓ and ∂ℓ/∂log π in one pass, sharing subexpressions (the fused path).",
                  [value, grad], obj.params),
    ]) + "\n"


def compile_objective(obj: Objective):
    """(objective, objective_and_grad, source) as Python callables."""
    import torch
    source = torch_source(obj)
    namespace = {"torch": torch}
    exec(compile(source, f"<objective {obj.name}>", "exec"), namespace)
    return namespace["objective"], namespace["objective_and_grad"], source
