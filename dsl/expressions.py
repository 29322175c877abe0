"""One expression: Lark's tree -> IR, in the scope of its file (built-ins, parameters and
bindings, each binding resolved once), calls checked against the operation rows; and the
checks of the result: numbers and conditions where each belongs, and a dependence on the
policy that has a gradient."""
from __future__ import annotations

import math
import unicodedata
from fractions import Fraction

from dsl.ir import Node, Pos, num, postorder
from dsl.controls import STEP
from dsl.names import BUILTINS, GRADIENT, MEANT, canonical_name, display_name
from dsl.operations import FUNCTIONS, OPS, passes_no_gradient
from dsl.printing import render
from dsl.source import Source, did_you_mean, lookalike

# Reductions other frameworks name that the language spells differently or does not have: each
# refused by name with the language's own (a batch statistic of the policy must say over what it
# reduces: the response, a prefix, the prompt's group or the optimizer batch).
_SCOPES = "seq_{0}(x) (its response), group_{0}(x) (its prompt's responses) or batch_{0}(x) (the optimizer batch)"
_WIDE = "compute it into the advantages (a maximum, an order statistic or a normalization over more than a " \
        "response is not in the language)"
NOT_IN_LANGUAGE = {
    **{k: "say which tokens it reduces: " + _SCOPES.format(k) for k in ("mean", "sum")},
    "std": "write group_std(x), the sample standard deviation over a prompt's responses",
    "var": "write group_std(x)^2, the sample variance over a prompt's responses",
    "count": "write seq_len, group_count(x) or batch_count(x)",
    **{k: "write prefix_sum(x), the running sum along the response" for k in ("cumsum", "running_sum")},
    "cumprod": "write exp(prefix_sum(log(x))), the prefix product",
    "batch_std": "write sqrt(batch_mean(x^2) - batch_mean(x)^2), the batch's population standard deviation",
    **{k: _WIDE for k in ("cummax", "cummin", "argmax", "argmin", "topk", "top_k", "kthvalue", "rank", "softmax",
                          "logsumexp", "whiten", "normalize")},
    **{k: f"write batch_quantile(x, {q}), the batch's {what}" for k, q, what in (
        ("batch_max", 1, "largest"), ("batch_min", 0, "smallest"), ("median", 0.5, "median"))},
    "seq_median": "write seq_quantile(x, 0.5), the response's median",
    **{k: "write batch_quantile(x, q), or seq_quantile(x, q) along a response, q in [0, 1] (or group_max(x), "
          "group_min(x))" for k in ("quantile", "percentile")},
}


def superscript(text: str) -> int:
    """⁻¹² -> -12."""
    return int(unicodedata.normalize("NFKC", text.replace("⁻", "-").replace("⁺", "")))


class Expressions:
    """Lark subtrees -> IR in one file's scope. `resolved` holds each binding used, built once
    (a binding used twice is one shared Node)."""

    def __init__(self, src: Source, params: dict, bindings: dict):
        self.src, self.params, self.bindings = src, params, bindings
        self.resolved: dict[str, Node] = {}

    def number(self, tok) -> Fraction:
        # float() first: Fraction("1e99999999") would build a 10^99999999-digit integer
        if not math.isfinite(float(tok.value)):
            raise self.src.error(f"the number '{tok.value}' is not finite in double precision",
                                 self.src.pos(tok.start_pos), "write a number below 1.8e308")
        return Fraction(tok.value)

    def build(self, t, stack=()) -> Node:
        pos = self.src.meta_pos(t)
        kids = [c for c in t.children if hasattr(c, "data")]
        rec = lambda c: self.build(c, stack)    # noqa: E731
        d = t.data
        if d == "number":
            return Node("num", value=self.number(t.children[0]), pos=pos)
        if d == "name":
            return self._name(t.children[0], stack)
        if d == "call":
            return self._call(t, [rec(c) for c in kids])
        if d == "implicit":
            return self._implicit(t, rec)
        if d == "sup":
            return Node("pow", (rec(kids[0]), num(superscript(t.children[1].value))), pos=pos)
        if d == "pos":
            return rec(kids[0])
        if d == "abs":
            return Node("abs", (rec(kids[0]),), pos=pos)
        if d == "indicator":
            return Node("ind", (rec(kids[0]),), pos=pos)
        op = d.rstrip("_")
        return Node(op, tuple(rec(c) for c in kids), pos=pos)

    def _name(self, tok, stack) -> Node:
        name, pos = canonical_name(tok.value), self.src.pos(tok.start_pos)
        if name in BUILTINS:
            return Node("var", value=name, pos=pos)
        if name in self.params:
            return Node("param", value=name, pos=pos)
        if name == STEP and name not in self.bindings:
            # the step counter is a parameter the loss core sets at every step (dsl.controls)
            self.params[STEP] = Fraction(0)
            return Node("param", value=name, pos=pos)
        if name in self.bindings:
            if name in stack:
                raise self.src.error(f"'{tok.value}' is defined in terms of itself", pos)
            if name not in self.resolved:
                self.resolved[name] = self.build(self.bindings[name], stack + (name,))
            return self.resolved[name]
        if name in FUNCTIONS:
            raise self.src.error(f"'{tok.value}' is a function; call it as {tok.value}(...)", pos)
        known = list(BUILTINS) + list(self.params) + list(self.bindings)
        meant = MEANT.get(tok.value.lower())
        if meant is not None and canonical_name(meant) not in self.params:
            raise self.src.error(f"unknown name '{tok.value}'", pos,
                                 f"the built-in {meant} is {BUILTINS[canonical_name(meant)]}; or declare "
                                 f"'{tok.value}' as a parameter on its own line, e.g. '{tok.value} = 0.1'")
        raise self.src.error(f"unknown name '{tok.value}'", pos,
                             f"declare it as a parameter on its own line, e.g. '{tok.value} = 0.1'"
                             f"{lookalike(tok.value, [display_name(k) for k in known]) or did_you_mean(name, known)}")

    def _call(self, t, args) -> Node:
        tok = t.children[0]
        raw, name, pos = tok.value, canonical_name(tok.value), self.src.pos(tok.start_pos)
        if name not in FUNCTIONS:
            if name in NOT_IN_LANGUAGE:
                raise self.src.error(f"'{raw}' is not a function of the language", pos, NOT_IN_LANGUAGE[name])
            if name in BUILTINS or name in self.params or name in self.bindings:
                raise self.src.error(f"'{raw}' is not a function", pos, f"to multiply, write {raw}*(...)")
            raise self.src.error(f"unknown function '{raw}'", pos,
                                 f"functions are: {', '.join(FUNCTIONS)}{did_you_mean(name, FUNCTIONS)}")
        lo, hi = FUNCTIONS[name]
        if len(args) < lo or (hi is not None and len(args) > hi):
            want = f"{lo}" if lo == hi else (f"at least {lo}" if hi is None else f"{lo} to {hi}")
            raise self.src.error(f"{name}() takes {want} argument{'s' if want != '1' else ''}, got {len(args)}",
                                 pos, f"write {OPS[name].signature}")
        # seq_quantile's and batch_quantile's q: a number or a parameter (its range: Objective.check_constants)
        for i, _, _ in OPS[name].constants:
            if any(m.op == "var" or OPS.get(m.op, OPS["add"]).reduce for m in args[i].walk()):
                raise self.src.error(f"{name}'s argument {i + 1} must be a constant, got '{render(args[i])}'",
                                     args[i].pos or pos, f"write {OPS[name].signature} with a number or a parameter "
                                     "there (one q for every token: a q per token is no order statistic)")
        return Node(name, tuple(args), pos=pos)

    def _implicit(self, t, rec) -> Node:
        num_tok = t.children[0]
        rest = [c for c in t.children[1:]]
        operand = rest[0]
        op_pos = self.src.meta_pos(operand) if hasattr(operand, "data") else self.src.pos(operand.start_pos)
        if self.src.norm[num_tok.end_pos].isspace():
            raise self.src.error("implicit multiplication needs the number directly before its factor",
                                 op_pos, f"write {num_tok.value}*... or remove the space")
        base = rec(operand)
        tail = rest[1:]
        if tail and getattr(tail[0], "type", "") == "SUPERSCRIPT":
            base = Node("pow", (base, num(superscript(tail[0].value))), pos=op_pos)
        elif tail:
            base = Node("pow", (base, rec(tail[-1])), pos=op_pos)
        return Node("mul", (Node("num", value=self.number(num_tok), pos=self.src.pos(num_tok.start_pos)), base),
                    pos=self.src.pos(num_tok.start_pos))


# ------------------------------------------------------------------ checks of the result
def check_kind(src: Source, root: Node, want: str):
    """Numbers where numbers belong, conditions inside [...], and/or/not."""
    seen, stack = set(), [(root, want)]
    while stack:            # each (node, expected kind) once, without recursion
        n, want = stack.pop()
        if (n, want) in seen:
            continue
        seen.add((n, want))
        kind = "num" if n.op in ("num", "var", "param") else OPS[n.op].kind
        if kind != want:
            if want == "num":
                raise src.error(f"the condition '{render(n)}' is used as a number", n.pos,
                                f"write [{render(n)}] for its 0/1 indicator")
            raise src.error(f"expected a condition, found the number '{render(n)}'", n.pos,
                            "conditions use < <= > >= == != and, or, not; e.g. [r > 1]")
        if n.op in OPS:
            stack.extend((a, OPS[n.op].args_kind) for a in n.args)


def check_policy(src: Source, expr: Node, pos: Pos):
    """r, π or H reaches the objective through something with a nonzero derivative."""
    live = set()
    for n in postorder(expr):
        if (n.op == "var" and n.value in GRADIENT) or (
                any(a in live for a in n.args) and not passes_no_gradient(n.op)):
            live.add(n)
    if expr not in live:
        inputs = [display_name(k) for k in ("pi_ref", "sum_pi_sq") if any(n.op == "var" and n.value == k
                                                                          for n in expr.walk())]
        why = f"; {' and '.join(inputs)} {'are inputs' if len(inputs) > 1 else 'is an input'} without a gradient" \
            if inputs else ""
        raise src.error("the objective does not depend on the policy", pos,
                        f"use r, π or H outside sg(...), [...] and sign(...); otherwise its gradient is zero{why}")
