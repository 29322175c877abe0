"""Hypothesis strategies shared by the tests: random objective expressions over every
operation the language has (kept finite-ish: divisions and logs of 1 + x²)."""
from hypothesis import strategies as st

LEAVES = st.sampled_from(["r", "π", "μ", "A", "δ", "2", "0.5"])
OBJECTIVES = st.recursive(LEAVES, lambda inner: st.one_of(
    st.tuples(inner, st.sampled_from(["+", "-", "*"]), inner).map(lambda t: f"({t[0]}){t[1]}({t[2]})"),
    st.tuples(inner, inner).map(lambda t: f"({t[0]})/(1 + ({t[1]})^2)"),
    inner.map(lambda x: f"|{x}|"), inner.map(lambda x: f"({x})^2"),
    st.tuples(st.sampled_from(["exp", "sign", "sg"]), inner).map(lambda t: f"{t[0]}(({t[1]})/4)"),
    inner.map(lambda x: f"log(1 + ({x})^2)"), inner.map(lambda x: f"sqrt(1 + ({x})^2)"),
    st.tuples(st.sampled_from(["min", "max"]), inner, inner).map(lambda t: f"{t[0]}({t[1]}, {t[2]})"),
    st.tuples(inner, inner, inner).map(lambda t: f"clip({t[0]}, {t[1]}, {t[2]})"),
    st.tuples(inner, st.sampled_from(["<", ">="]), inner, inner).map(lambda t: f"[{t[0]} {t[1]} {t[2]}]*({t[3]})"),
), max_leaves=8)
