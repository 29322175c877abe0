"""The fourth version's vocabulary reductions: a sum over the token's vocabulary support, entry by
entry, with the current policy's probability of each entry (π_v) and π_ref's or a teacher's
(π_ref_v) as symbols (docs/language.md). The support is a top-k: `ref_topk_sum` sums over the k
entries π_ref (the teacher) ranks highest, `topk_sum` over the current policy's; the mass outside
it, the tail bucket, is 1 − ref_topk_sum(π_v) for the policy and 1 − ref_topk_sum(π_ref_v) for the
reference, so a KL over the k + 1 categories is written with the tail as its own term.

What a reduction may read is checked here, once, where the objective is parsed: its argument reads
the entries (π_v, π_ref_v), numbers and parameters only, and an entry is read inside one only."""
from __future__ import annotations

from dsl.errors import DslError
from dsl.ir import Node
from dsl.names import ENTRIES, display_name
from dsl.operations import OPS
from dsl.printing import render

# whose top-k each vocabulary reduction sums over, as the loss core names the support it is given
SUPPORTS = {"ref_topk_sum": "reference", "topk_sum": "policy"}


def is_vocabulary(n: Node) -> bool:
    return n.op in OPS and OPS[n.op].over == "vocab"


def support(expr: Node) -> str | None:
    """'reference' or 'policy': whose top-k the objective's vocabulary reductions sum over (None: it has none)."""
    found = {SUPPORTS[n.op] for n in expr.walk() if is_vocabulary(n)}
    return found.pop() if found else None


def check_vocabulary(src, expr: Node) -> None:
    """Each entry symbol inside a vocabulary reduction, each such reduction reading entries, numbers
    and parameters only (a token's value, a reduction, another vocabulary sum inside one is refused:
    its per-entry gradient would have to be summed back to the token), one support per objective."""
    seen: dict[str, Node] = {}
    stack, done = [expr], set()
    while stack:                       # the objective outside its vocabulary reductions
        n = stack.pop()
        if n in done:
            continue
        done.add(n)
        if n.op == "var" and n.value in ENTRIES:
            raise src.error(f"{display_name(n.value)} is the probability of one vocabulary entry: it is read only "
                            "inside ref_topk_sum(...) or topk_sum(...)", n.pos,
                            f"e.g. ref_topk_sum(π_ref_v*(log(π_ref_v) - log(π_v))), a sum over the support")
        if is_vocabulary(n):
            _check_argument(src, n)
            seen.setdefault(n.op, n)
            continue
        stack.extend(n.args)
    if len(seen) > 1:
        later = max(seen.values(), key=lambda n: (n.pos.line, n.pos.col) if n.pos else (0, 0))
        raise src.error(f"'{later.op}' sums over another support than '{next(k for k in seen if k != later.op)}': "
                        "one objective reads one top-k (the reference's or the policy's)", later.pos,
                        "use ref_topk_sum(...) or topk_sum(...) throughout")


def _check_argument(src, n: Node) -> None:
    arg, reads = n.args[0], False
    for m in arg.walk():
        if m.op == "var" and m.value not in ENTRIES:
            raise src.error(f"{n.op}(...) reads vocabulary entries, numbers and parameters only: "
                            f"'{display_name(m.value)}' is one value per token", m.pos or n.pos,
                            f"multiply outside the sum, e.g. {display_name(m.value)}*{n.op}(...)")
        if m.op in OPS and OPS[m.op].reduce:
            raise src.error(f"{n.op}(...) cannot hold the reduction '{render(m)}'", m.pos or n.pos,
                            "a vocabulary sum reads one token's entries: compute the reduction outside it")
        reads |= m.op == "var"
    if not reads:
        raise src.error(f"{n.op}({render(arg)}) reads no vocabulary entry", n.pos,
                        f"sum a function of π_v and π_ref_v, e.g. {n.op}(π_v) (the policy's mass on the support)")


def refuse_r_analysis(obj) -> None:
    """drpo-analyze's refusal: its analysis (w, the trust-region boundaries, the range) reads ℓ as a
    function of the sampled token's ratio r, and a vocabulary sum is not one: its gradient reaches
    every entry of the support through the softmax, the sampled token's too where it is in the
    support, so no weight w of r alone describes it. Said at the first such sum, never a weight."""
    found = [n for n in obj.expr.walk() if is_vocabulary(n)]
    if not found:
        return
    n = min(found, key=lambda m: (m.pos.line, m.pos.col) if m.pos else (1 << 30, 0))     # the first in the file
    pos = n.pos
    lines = obj.source.split("\n")
    line = lines[pos.line - 1] if pos and pos.line <= len(lines) else None
    raise DslError(f"the r-analysis does not apply to the vocabulary sum {n.op}(...): its gradient reaches every "
                   "entry of the support through the softmax, not the sampled token's ratio r alone, so no weight "
                   f"w, boundary or range of r describes it (its level: token; the objective's locality: "
                   f"{obj.facts.locality})", obj.path, pos.line if pos else 1, pos.col if pos else 1, line,
                   "train it with drpo-train (ref_topk_sum, --drpo.vocab_topk K) or CompiledLoss, given the support's "
                   "log-probs; its gradient is held to autograd and to a float64 full-softmax reference in "
                   "tests/test_vocabulary.py")
