"""Where each value of an objective lives, decided on the IR alone: its level (a number, one value
for the whole batch, one per response, or one per token), which sets what a group or batch
reduction reduces; each reduction with what it reads; and the objective's locality, the widest
reduction a policy-dependent value passes through (docs/language.md)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from dsl.ir import Node, postorder
from dsl.names import ENTRIES, GRADIENT, POLICY
from dsl.operations import OPS, passes_no_gradient

LEVELS = ("constant", "batch", "response", "token", "entry")   # each holds the ones before it
WIDTHS = ("token", "response", "group", "batch")         # an objective's locality, narrowest first
# the width of each kind of reduction (a prefix and a turn read only their own response)
_WIDTH = {"response": "response", "prefix": "response", "suffix": "response", "turn": "response", "group": "group",
          "batch": "batch", "vocab": "token"}     # a vocabulary reduction reads its own token's distribution only
# the generated code's own names for the current policy (core.rewrites writes log π and log r so)
_POLICY = set(POLICY) | {"logp", "log_ratio"}
_GRADIENT = set(GRADIENT) | {"logp", "log_ratio"}


# the token-level built-ins every host holds constant along a response (one advantage per response):
# a group reduction that is token-level only through them is position by position, where a reader
# expects each response once (a longer response's later tokens are compared with fewer others)
PER_RESPONSE = ("A",)


def levels(root: Node, per_response: tuple = ()) -> dict[Node, str]:
    """Each node's level (LEVELS): a number or parameter is a constant; seq_len, a response
    reduction and a group reduction of a response-level value are one value per response; a batch
    reduction one for the batch; every other built-in (turn_len, staleness), a prefix, a turn and a
    group reduction of a token-level value, one per token; π_v and π_ref_v one per vocabulary entry
    of the token's support, and a vocabulary reduction of them one per token. An operation is at its
    widest argument's level. A turn's value is held along the turn only, not the response: 'token', as
    a prefix's (no level between: what reads a level, a group or batch reduction, takes each response
    once or each token, and a turn-level value is not one value per response).
    `per_response`: built-ins taken as one value per response (PER_RESPONSE: what hosts give), and
    a prefix mean of such a value is it (prefix_mean(A) is A at every position; prefix_sum(A) is p·A)."""
    out: dict[Node, str] = {}
    for n in postorder(root):
        if n.op in ("num", "param"):
            out[n] = "constant"
        elif n.op == "var":
            out[n] = "response" if n.value == "seq_len" or n.value in per_response else \
                "entry" if n.value in ENTRIES else "token"
        elif n.op in OPS and OPS[n.op].reduce:
            over, arg = OPS[n.op].over, out[n.args[0]]
            out[n] = {"response": "response", "prefix": "token", "suffix": "token", "turn": "token", "batch": "batch",
                      "group": "token" if arg == "token" else "response", "vocab": "token"}[over]
            if per_response and over in ("prefix", "turn") and OPS[n.op].reduce == "mean" and arg != "token":
                out[n] = arg    # the running (turn's) mean of a value constant along the response is that value
        else:
            out[n] = max((out[a] for a in n.args), key=LEVELS.index, default="constant")
    return out


def argument_level(n: Node, level: dict) -> str:
    """What a group or batch reduction reduces: 'token' (each unmasked token; for a group, position
    by position) or 'response' (each non-empty response once: a constant, a batch or a response value)."""
    return "token" if level[n.args[0]] == "token" else "response"


@dataclass(frozen=True)
class Reduction:
    node: Node
    over: str          # what it reads (dsl.operations.OVER)
    level: str         # argument_level: 'token' or 'response'
    policy: bool       # its argument reads the current policy (π, r, H or Σ_v π_v²), even under sg
    gradient: bool     # a gradient passes through it: its argument depends on π, r or H outside sg, and
                       # it is not itself under sg (sg(group_mean(r)) reads the policy, passes no gradient)

    @property
    def width(self) -> str:
        return _WIDTH[self.over]


def reductions(root: Node, level: dict | None = None) -> list[Reduction]:
    """Every reduction in the objective, parents before children (`level`: root's levels, if known)."""
    level, policy, live = levels(root) if level is None else level, set(), set()
    for n in postorder(root):
        if n.op == "var":
            if n.value in _POLICY:
                policy.add(n)
            if n.value in _GRADIENT:
                live.add(n)
        elif n.op in OPS:
            counts = OPS[n.op].reduce == "count"       # a count reads no value
            if any(a in policy for a in n.args) and not counts:
                policy.add(n)
            if any(a in live for a in n.args) and not passes_no_gradient(n.op):
                live.add(n)
    # the nodes the objective's gradient reaches: not below sg, a condition or a count
    reached, stack = {root}, [root]
    while stack:
        n = stack.pop()
        if n.op in OPS and passes_no_gradient(n.op):
            continue
        for a in n.args:
            if a not in reached:
                reached.add(a)
                stack.append(a)
    out = []
    for n in root.walk():
        if n.op in OPS and OPS[n.op].reduce:
            reads = OPS[n.op].reduce != "count"
            out.append(Reduction(n, OPS[n.op].over, argument_level(n, level), reads and n.args[0] in policy,
                                 reads and n.args[0] in live and n in reached))
    return out


class Facts:
    """What dsl.levels says of one expression, each fact computed at most once, when first read:
    Objective.facts holds its expression's, read by the analysis and the compiler alike."""

    def __init__(self, root: Node):
        self.root = root

    @cached_property
    def level(self) -> dict[Node, str]:
        """Each node's level (levels)."""
        return levels(self.root)

    def part(self, node: Node) -> "Facts":
        """The facts of a part of this expression (facts(node)), its levels read from this one's
        where they are known: a node's level is its sub-expression's alone (an indicator's view)."""
        out, nodes = facts(node), list(postorder(node))
        for name in ("level", "level_per_response"):
            known = vars(self).get(name)
            if known is not None and name not in vars(out) and all(m in known for m in nodes):
                vars(out)[name] = {m: known[m] for m in nodes}
        return out

    @cached_property
    def level_per_response(self) -> dict[Node, str]:
        """Each node's level, PER_RESPONSE's built-ins taken as one value per response."""
        return levels(self.root, PER_RESPONSE)

    @cached_property
    def reductions(self) -> tuple[Reduction, ...]:
        return tuple(reductions(self.root, self.level))

    @cached_property
    def by_position_only(self) -> tuple[Node, ...]:
        """The group reductions (counts aside) whose argument is token-level only through a built-in
        hosts hold constant along a response (PER_RESPONSE): group_mean(A) is position by position,
        so a winning response longer than the others gets A − A = 0 past their ends;
        group_mean(seq_mean(A)) reduces each response once."""
        token, held = self.level, self.level_per_response
        return tuple(r.node for r in self.reductions if r.over == "group" and OPS[r.node.op].reduce != "count"
                     and token[r.node.args[0]] == "token" and held[r.node.args[0]] != "token")

    @cached_property
    def locality(self) -> str:
        """token | response | group | batch: the widest reduction whose argument reads the current
        policy (a statistic of fixed inputs, as group_mean(A), could be computed before the update)."""
        return max((r.width for r in self.reductions if r.policy), key=WIDTHS.index, default="token")

    @cached_property
    def gradient_width(self) -> str:
        """The widest reduction a gradient passes through (narrower than locality where the wide
        one reads the policy under sg only)."""
        return max((r.width for r in self.reductions if r.gradient), key=WIDTHS.index, default="token")

    @cached_property
    def kept_whole(self) -> tuple[str, ...]:
        """What one loss call must hold whole for the compiled loss to be exact: 'groups' where the
        objective has a group reduction, 'batch' where it has a batch reduction (the core computes
        every reduction over what its call holds, fixed inputs' statistics included)."""
        overs = {r.over for r in self.reductions}
        return tuple(k for k, over in (("groups", "group"), ("batch", "batch")) if over in overs)

    @cached_property
    def vocabulary(self) -> tuple[Node, ...]:
        """The vocabulary reductions (topk_sum, ref_topk_sum: the fourth version), each reading the
        token's support entry by entry (dsl.vocabulary)."""
        return tuple(r.node for r in self.reductions if r.over == "vocab")

    @cached_property
    def third_version(self) -> bool:
        """Whether the objective reads π_ref, H, Σ_v π_v², turn_len or staleness, or has a prefix, turn,
        group or batch reduction, or a vocabulary sum (the TokenBatch's inputs beyond log π, μ, A and the
        mask; a vocabulary sum is compiled as the third version's: core.codegen's reverse mode)."""
        return any((n.op == "var" and n.value in ("pi_ref", "H", "sum_pi_sq", "turn_len", "staleness")) or
                   (n.op in OPS and OPS[n.op].over in ("prefix", "turn", "group", "batch", "vocab"))
                   for n in self.root.walk())


@lru_cache(maxsize=64)
def facts(root: Node) -> Facts:
    """root's facts (Objective.facts): one record per expression, so that every reader of an
    objective, and of a copy of it (with overrides, or loaded again), computes each fact once."""
    return Facts(root)


# the facts of an expression that is no objective's, computed afresh
def by_position_only(root: Node) -> list[Node]:
    return list(Facts(root).by_position_only)


def locality(root: Node) -> str:
    return Facts(root).locality


def kept_whole(root: Node) -> tuple[str, ...]:
    return Facts(root).kept_whole


def third_version(root: Node) -> bool:
    return Facts(root).third_version
