"""Hypothesis strategies shared by the tests: random objective expressions over every
operation the language has (kept finite-ish: divisions and logs of 1 + x²). POLICY_OBJECTIVES
and SEQUENCE_OBJECTIVES depend on the policy by construction, so the parser accepts every draw
and a test filters (with assume(), reporting why) only what its own property cannot compare."""
from hypothesis import strategies as st

from dsl.operations import OPS

LEAVES = st.sampled_from(["r", "π", "μ", "A", "δ", "2", "0.5"])


_SIDES = st.one_of(LEAVES, st.tuples(LEAVES, st.sampled_from(["+", "-", "*"]), LEAVES).map(" ".join))
# every comparison, combined by and/or/not (constant sides included: `δ < 2`)
CONDITIONS = st.recursive(
    st.tuples(_SIDES, st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), _SIDES).map(" ".join),
    lambda c: st.one_of(st.tuples(c, st.sampled_from(["and", "or"]), c).map(lambda t: f"({t[0]}) {t[1]} ({t[2]})"),
                        c.map(lambda x: f"not ({x})")), max_leaves=3)


def _forms(inner, other, smooth):
    """Every operation on `inner`, the other operands drawn from `other`; `smooth` the unary
    functions allowed (sign and sg pass no gradient through)."""
    def anywhere(parts, slot, write):
        # `inner` in one slot (any of them), `other` in the rest
        return st.tuples(*[inner if i == slot else other for i in range(parts)]).map(lambda t: write(*t))
    return st.one_of(
        *[st.tuples(st.sampled_from(["+", "-", "*"]), anywhere(2, i, lambda a, b: (a, b))).map(
            lambda t: f"({t[1][0]}){t[0]}({t[1][1]})") for i in (0, 1)],
        *[anywhere(2, i, lambda a, b: f"({a})/(1 + ({b})^2)") for i in (0, 1)],
        inner.map(lambda x: f"|{x}|"), inner.map(lambda x: f"({x})^2"),
        st.tuples(st.sampled_from(smooth), inner).map(lambda t: f"{t[0]}(({t[1]})/4)"),
        inner.map(lambda x: f"log(1 + ({x})^2)"), inner.map(lambda x: f"sqrt(1 + ({x})^2)"),
        *[st.tuples(st.sampled_from(["min", "max"]), anywhere(2, i, lambda a, b: (a, b))).map(
            lambda t: f"{t[0]}({t[1][0]}, {t[1][1]})") for i in (0, 1)],
        *[anywhere(3, i, lambda x, lo, hi: f"clip({x}, {lo}, {hi})") for i in (0, 1, 2)],
        st.tuples(CONDITIONS, inner).map(lambda t: f"[{t[0]}]*({t[1]})"),
    )


SMOOTH = ["exp", "erf", "atan", "softsign"]
# any expression: it may not depend on the policy at all (the parser refuses those)
OBJECTIVES = st.recursive(LEAVES, lambda inner: _forms(inner, inner, SMOOTH + ["sign", "sg"]), max_leaves=8)
# r or π reaches the top through operations with a gradient, never only inside sg, sign or
# [...]: the other operands are any small expression, with or without the policy
_OPERANDS = st.recursive(LEAVES, lambda inner: _forms(inner, inner, SMOOTH + ["sign", "sg"]), max_leaves=3)
POLICY_OBJECTIVES = st.recursive(st.sampled_from(["r", "π"]), lambda live: _forms(live, _OPERANDS, SMOOTH),
                                 max_leaves=6)


# Objectives as researchers write them (issue 8): sums of surrogate terms (clipped, dual-clipped,
# masked) and penalties that depend on μ and A, with thresholds that may depend on μ.
_SIZES = st.sampled_from(["0.1", "0.2", "0.28", "0.5", "1.5"])
_THRESHOLD = st.one_of(_SIZES, _SIZES.map(lambda c: f"{c}*μ"))
_TERMS = st.one_of(
    st.just("r*A"),
    st.tuples(_THRESHOLD, _THRESHOLD).map(lambda t: f"min(r*A, clip(r, 1 - {t[0]}, 1 + {t[1]})*A)"),
    st.tuples(_THRESHOLD, st.sampled_from(["2", "3"])).map(
        lambda t: f"max(min(r*A, clip(r, 1 - {t[0]}, 1 + {t[0]})*A), {t[1]}*A)"),
    st.tuples(st.sampled_from(["<=", "<"]), _THRESHOLD).map(lambda t: f"[A*(r - 1) {t[0]} 0 or |π - μ| <= {t[1]}]*r*A"),
    st.tuples(st.sampled_from(["μ*", ""]), _SIZES).map(lambda t: f"-|A|/(2*{t[1]})*{t[0]}(r - 1)^2"),
    _SIZES.map(lambda c: f"-(r - 1)^2/(2*{c})"),
    _SIZES.map(lambda c: f"-|A|*|π - μ|/{c}"),
    _SIZES.map(lambda c: f"-|A|*{c}*log(r)^2"),
)
# Terms that act only on part of the domain (issue 19): a band of |A|, μ near 0 or 1 or in a narrow
# band, π below a floor or in a narrow band of π − μ, log r clamped where only tiny μ reaches it.
_LEVELS = st.sampled_from(["1.5", "3", "7", "30", "60"])
GATES = st.one_of(
    st.tuples(_LEVELS, _LEVELS).map(lambda t: f"{min(t, key=float)} <= |A| and |A| <= {max(t, key=float)}"),
    _LEVELS.map(lambda c: f"|A| >= {c}"),
    st.sampled_from(["μ > 0.99", "μ > 0.95", "μ < 1e-4", "μ < 1e-7", "0.3 < μ and μ < 0.31"]),
    st.sampled_from(["π >= 1e-9", "π <= 0.5", "π - μ <= 0.2999 or π - μ >= 0.3001", "|log(r)| <= 12"]),
)
_CLAMPS = st.tuples(st.sampled_from(["12", "15"]), st.sampled_from(["", "|A|*"])).map(
    lambda t: f"{t[1]}clip(log(r), -{t[0]}, {t[0]})*A")
_GATED = st.one_of(
    st.tuples(GATES, _TERMS).map(lambda t: f"[{t[0]}]*({t[1]})"),
    st.tuples(GATES, _TERMS, _TERMS).map(lambda t: f"[{t[0]}]*({t[1]}) + [not ({t[0]})]*({t[2]})"),
    _CLAMPS,
)
RESEARCH_OBJECTIVES = st.lists(st.one_of(_TERMS, _GATED), min_size=1, max_size=3).map(
    lambda terms: " + ".join(f"({t})" for t in terms))


# Token-level forms that showed confident wrong claims (issue 45 item 4): exp/log compositions that
# round at extreme r, penalties not scaled by |A| (a boundary that moves with |A|), and odd-order
# flat zeros (w ~ (r − c)³), alone or beside the research terms above.
_ROUNDED = st.sampled_from(["exp(log(r))", "log(exp(r))", "exp(2*log(r))/r", "exp(log(π) - log(μ))",
                            "exp(log(r)/2)^2", "sqrt(r)^2"])
_UNSCALED = st.tuples(_SIZES, st.sampled_from(["|π - μ|", "(r - 1)^2", "μ*(r - 1)^2", "log(r)^2", "|r - 1|"])).map(
    lambda t: f"-{t[0]}*{t[1]}")
_FLAT = st.one_of(
    st.tuples(st.sampled_from(["3", "5"]), st.sampled_from(["0.5", "1.3", "1.655", "2.5"])).map(
        lambda t: f"(r - {t[1]})^{int(t[0]) + 1}/{int(t[0]) + 1}"),
    st.just("sqrt(1 + log(1 + (r - sqrt(1 + log(1 + r^2)^2))^2)^2)"),
    st.sampled_from(["1.3", "2.5"]).map(lambda c: f"log(1 + (r - {c})^4)"),
)
TOKEN_OBJECTIVES = st.lists(st.one_of(_TERMS, _ROUNDED.map(lambda x: f"{x}*A"), _UNSCALED,
                                      st.tuples(_SIZES, _FLAT).map(lambda t: f"{t[0]}*{t[1]}*A"), _FLAT),
                            min_size=1, max_size=3).map(lambda terms: " + ".join(f"({t})" for t in terms))

# Sequence objectives: random objectives around reductions over each response (nested too),
# the response length, and the two policies besides μ; a reduction of the policy in each.
_REDUCTIONS = st.sampled_from(["seq_mean", "seq_sum", "seq_max", "seq_min"])
_SEQ_LEAVES = st.one_of(OBJECTIVES, st.sampled_from(["seq_len", "π_old", "pi_rollout", "log(π_old) - log(μ)"]))
_REDUCED = st.tuples(_REDUCTIONS, _SEQ_LEAVES).map(lambda t: f"{t[0]}({t[1]})")
_LIVE_REDUCED = st.tuples(_REDUCTIONS, st.one_of(POLICY_OBJECTIVES, st.just("log(π) - log(π_old)"))).map(
    lambda t: f"{t[0]}({t[1]})")
SEQUENCE_OBJECTIVES = st.one_of(
    # a length filter: the response's tokens kept only for some lengths (|y| = 1 where analysed)
    st.tuples(st.sampled_from(["<=", ">="]), st.sampled_from(["1", "2", "100"]), POLICY_OBJECTIVES).map(
        lambda t: f"[seq_len {t[0]} {t[1]}]*({t[2]})"),
    st.tuples(_SEQ_LEAVES, st.sampled_from(["+", "-", "*"]), _LIVE_REDUCED).map(lambda t: f"({t[0]}){t[1]}({t[2]})"),
    st.tuples(_REDUCTIONS, _SEQ_LEAVES, _LIVE_REDUCED).map(lambda t: f"{t[0]}(({t[1]})*({t[2]}))*A"),
    st.tuples(_REDUCED, _LIVE_REDUCED, st.booleans()).map(
        lambda t: f"exp(({t[0]})/8)*({t[1]})" if t[2] else f"exp(({t[1]})/8)*({t[0]})"),
)


# The third version: random compositions of the prefix, group and batch reductions (nested too), over
# the new inputs, response-level values and the objectives above; every such row of the table.
_V3_REDUCTIONS = st.sampled_from([k for k, op in OPS.items() if op.callable and op.over in ("prefix", "group", "batch")])
_V3_LEAVES = st.one_of(OBJECTIVES, st.sampled_from(["H", "sum_π_sq", "log(π_ref) - log(μ)", "seq_mean(r)", "seq_len",
                                                    "sg(r)"]))
_V3_REDUCED = st.tuples(_V3_REDUCTIONS, _V3_LEAVES).map(lambda t: f"{t[0]}({t[1]})")
V3_OBJECTIVES = st.one_of(
    st.tuples(_V3_LEAVES, st.sampled_from(["+", "-", "*"]), _V3_REDUCED).map(lambda t: f"({t[0]}){t[1]}({t[2]})"),
    st.tuples(_V3_REDUCTIONS, _V3_LEAVES, _V3_REDUCED).map(lambda t: f"{t[0]}(({t[1]})*({t[2]}))*A"),
    st.tuples(_V3_REDUCED, _V3_REDUCED).map(lambda t: f"exp(({t[0]})/8)*({t[1]})"),
    st.tuples(_V3_REDUCED, _V3_LEAVES).map(lambda t: f"({t[1]})/(1 + ({t[0]})^2)"),
)


def draws(strategy, n):
    """n examples of `strategy`, the same ones on every run (derandomized, no database): what a
    test of a filter's rate counts over."""
    from hypothesis import HealthCheck, Phase, given, settings
    out = []

    @given(strategy)
    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    def collect(x):
        out.append(x)
    collect()
    return out
