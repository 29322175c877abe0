"""drpo-analyze --equiv (two objectives train identically, or a witness where they do not) and
the report's admissibility block (w(1) = 1, boundedness, tails, symmetry in log r)."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles import weight_function
from strategies import POLICY_OBJECTIVES

import dsl
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.present.report import to_json
from openrlhf_drpo.analysis.equiv import equivalence
from dsl.ir import Node, num, postorder
from dsl.walks import evaluate


def _obj(spec):
    """A shipped name, or the text of an objective."""
    return dsl.load(spec) if "\n" not in spec else dsl.parse(spec, "<test>")


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "openrlhf_drpo.cli", *args], capture_output=True, text=True, cwd=cwd)


def _grad_log_pi(obj, mu, pi, A, h=1e-6):
    """∂ℓ/∂log π by central differences of the objective's own float rules (sg held at the base
    point): an oracle for the witness independent of the derivative rules."""
    frozen = {}
    params = {k: float(v) for k, v in obj.params.items()}
    ell = lambda p: evaluate(obj.expr, {"r": p / mu, "mu": mu, "pi": p, "A": A, **params}, frozen)  # noqa: E731
    ell(pi)
    return (ell(pi * math.exp(h)) - ell(pi * math.exp(-h))) / (2 * h)


# ------------------------------------------------------------------ equivalent pairs
PPO_REWRITE = "ε_low = 0.2\nε_high = 0.2\nmin(A*r, A*clip(r, 1 - ε_low, 1 + ε_high))\n"
EQUIVALENT = [
    # (a, b, proven symbolically)
    ("surrogate", "sg(r)*A*log(π)\n", True),                         # ∂/∂r: A·μ/π = A/r·... = A
    ("surrogate", "r*A + 5*sg(r)^2*A\n", True),                      # a term without a gradient
    ("ppo", PPO_REWRITE, True),
    ("ppo", "[A > 0]*A*min(r, 1.2) + [A < 0]*A*max(r, 0.8)\n", True),   # PPO's clip written per sign of A
    ("dro", "τ = 0.05\nA*(log(r) + log(μ)) - τ/2*log(r)^2\n", True),    # log π = log r + log μ
    ("drpo", "r*A - |A|*μ*(r - 1)^2/25\n", True),                    # 2δ = 25
    ("spo", "A*r - (r - 1)^2*|A|*2.5\n", True),                      # 1/(2ε) = 2.5
    ("r*A*[r <= 1.2]\n", "r*A*[r < 1.2]\n", True),                   # differ only on the tie r = 1.2
    ("seq_mean(r)*A\n", "r*A\n", True),                              # on a uniform response: the scope says so
]


@pytest.mark.parametrize("a, b, proven", EQUIVALENT, ids=[f"{i}" for i in range(len(EQUIVALENT))])
def test_objectives_rewritten_by_algebra_are_equivalent(a, b, proven):
    res = equivalence(_obj(a), _obj(b))
    assert res["equivalent"] and res["gradient_equivalent"] and not res["options"], res
    assert res["numeric"]["points"] > 300_000 and not res["numeric"]["differs"]
    assert (res["symbolic"]["status"] == "proven") == proven, res["symbolic"]


def test_a_sequence_objective_is_compared_on_the_uniform_response_and_says_so():
    res = equivalence(_obj("seq_mean(r)*A\n"), _obj("r*A\n"), seq_len=3)
    assert res["scope"]["sequence"] and res["scope"]["seq_len"] == 3
    from openrlhf_drpo.analysis.present.equiv_report import equivalence_report
    assert "compared on a response whose |y| = 3 tokens share r, μ and A" in equivalence_report(res)


# ------------------------------------------------------------------ not equivalent
NOT_EQUIVALENT = [
    # (a, b, signs of A where the gradients differ, span of r inside the region (lo, hi) or None)
    ("ppo", "ε = 0.2\nA*min(r, clip(r, 1 - ε, 1 + ε))\n", {"negative"}, None),   # the same for A > 0 only
    ("ppo", "grpo_clip_higher", {"positive"}, (1.2, 1.28)),                     # a perturbed parameter: ε_high
    ("drpo", "δ = 12\nr*A - |A|/(2δ)*μ*(r-1)^2\n", {"positive", "negative"}, None),
    ("r*A*[r >= 1]\n", "r*A*[r > 1]\n", {"positive", "negative"}, (1.0, 1.0)),  # at r = 1 only: the first mini-batch
    ("dro", "drpo", {"positive", "negative"}, None),                          # "DRO" is not DRPO
    ("surrogate", "r*A + 0.001*r*A\n", {"positive", "negative"}, None),
]


@pytest.mark.parametrize("a, b, signs, span", NOT_EQUIVALENT, ids=[f"{i}" for i in range(len(NOT_EQUIVALENT))])
def test_different_objectives_are_not_equivalent_with_a_true_witness(a, b, signs, span):
    oa, ob = _obj(a), _obj(b)
    res = equivalence(oa, ob)
    assert not res["equivalent"] and not res["gradient_equivalent"]
    regions = res["numeric"]["region"]
    assert {adv for adv, reg in regions.items() if reg} == signs
    if span:
        lo, hi = span
        rs = [x for reg in regions.values() if reg for side in reg["r"] for x in side]
        assert min(rs) >= lo * (1 - 1e-6) and max(rs) <= hi * (1 + 1e-6) and min(rs) <= hi, rs
    w = res["numeric"]["witness"]
    ga, gb = w["gradients"]
    assert ga is not None and gb is not None and abs(ga - gb) > 1e-6 * max(abs(ga), abs(gb))
    if w["r"] != 1.0:       # at r = 1 the two sides of a mask differ: no central difference there
        for g, o in ((ga, oa), (gb, ob)):
            assert g == pytest.approx(_grad_log_pi(o, w["mu"], w["pi"], w["A"]), rel=1e-4, abs=1e-9)


@pytest.mark.parametrize("a, b, option", [
    ("ppo", "@aggregate = seq-mean-token-mean\nmin(r*A, clip(r, 0.8, 1.2)*A)\n", "aggregate"),
    ("ppo", "@anchor = rollout\nmin(r*A, clip(r, 0.8, 1.2)*A)\n", "anchor"),
])
def test_an_options_difference_is_not_equivalent_and_is_reported_as_such(a, b, option):
    res = equivalence(_obj(a), _obj(b))
    assert not res["equivalent"] and res["gradient_equivalent"]
    assert [o["option"] for o in res["options"]] == [option]
    from openrlhf_drpo.analysis.present.equiv_report import equivalence_report
    text = equivalence_report(res)
    assert text.startswith("not equivalent") and f"options    differ: @{option} = " in text


# ------------------------------------------------------------------ the command
def test_the_cli_exits_0_when_equivalent_1_with_a_witness_when_not(tmp_path):
    (tmp_path / "clip_only.dsl").write_text("ε = 0.2\nA*min(r, clip(r, 1 - ε, 1 + ε))\n")
    (tmp_path / "ppo2.dsl").write_text(PPO_REWRITE)
    same = _cli("--equiv", "ppo", "ppo2.dsl", cwd=tmp_path)
    assert same.returncode == 0, same.stderr
    assert same.stdout.startswith("equivalent: ppo and ppo2") and "proof      symbolic" in same.stdout
    other = _cli("--equiv", "ppo", "clip_only.dsl", cwd=tmp_path)
    assert other.returncode == 1, other.stderr
    assert other.stdout.startswith("not equivalent: ppo and clip_only")
    assert "witness    μ = " in other.stdout and "A > 0: the same everywhere sampled" in other.stdout
    data = json.loads(_cli("--equiv", "ppo", "clip_only.dsl", "--json", cwd=tmp_path).stdout)
    assert data["equivalent"] is False and data["numeric"]["witness"]["A"] < 0


@pytest.mark.parametrize("args, message", [
    (["ppo", "nonexistent_objective"], "no objective file or shipped objective named 'nonexistent_objective'"),
    (["ppo", "{tmp}/bad.dsl"], "bad.dsl:2:"),
    (["ppo"], "--equiv compares exactly two objectives"),
    (["ppo", "drpo", "spo"], "--equiv compares exactly two objectives"),
    (["ppo", "drpo", "--set", "nope=1"], "unknown parameter 'nope'"),
])
def test_the_cli_exits_2_on_errors_in_either_file(tmp_path, args, message):
    (tmp_path / "bad.dsl").write_text("δ = 0.2\nr*A +* δ\n")
    proc = _cli("--equiv", *[a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr and "Traceback" not in proc.stderr and proc.stdout == ""


# ------------------------------------------------------------------ Hypothesis
def _rewrite(data, expr: Node) -> Node:
    """expr rewritten by identities, drawn per node: commuted sums and products, x·1, x + 0,
    (x + x) − x and (x·2)/2 (exact in doubles), exp(log(c)) for a positive constant c."""
    new: dict = {}
    for m in postorder(expr):
        x = Node(m.op, tuple(new[a] for a in m.args), m.value, m.pos) if m.args else m
        if x.op in ("add", "mul") and data.draw(st.booleans()):
            x = Node(x.op, x.args[::-1])
        if x.op in ("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"):     # conditions stay conditions
            new[m] = x
            continue
        choice = data.draw(st.sampled_from(["keep", "keep", "times one", "plus zero", "add sub", "mul div", "exp log"]))
        if choice == "times one":
            x = Node("mul", (x, num(1)))
        elif choice == "plus zero":
            x = Node("add", (num(0), x))
        elif choice == "add sub":
            x = Node("sub", (Node("add", (x, x)), x))
        elif choice == "mul div":
            x = Node("div", (Node("mul", (x, num(2))), num(2)))
        elif choice == "exp log" and x.op in ("num", "param") and (x.op == "param" or x.value > 0):
            x = Node("exp", (Node("log", (x,)),))
        new[m] = x
    return new[expr]


def _perturbed(expr: Node, eps) -> Node:
    """expr + ε·r·A: a term whose gradient ε·r·A is nonzero everywhere."""
    r, A = Node("var", value="r"), Node("var", value="A")
    return Node("add", (expr, Node("mul", (num(eps), Node("mul", (r, A))))))


def _random_objective(text):
    return dsl.parse(f"δ = 0.3\n{text}")       # the strategy depends on the policy by construction


@given(POLICY_OBJECTIVES, st.data())
@settings(max_examples=int(os.environ.get("DRPO_EXAMPLES", 12)), deadline=None,
          suppress_health_check=list(HealthCheck))
def test_a_random_objective_is_equivalent_to_itself_rewritten_by_identities(text, data):
    obj = _random_objective(text)
    rewritten = dataclasses.replace(obj, expr=_rewrite(data, obj.expr))
    res = equivalence(obj, rewritten)
    assert res["equivalent"], (text, res["numeric"].get("witness"), res["numeric"].get("region"))


@given(POLICY_OBJECTIVES, st.sampled_from([0.125, -0.5, 3.0]))
@settings(max_examples=int(os.environ.get("DRPO_EXAMPLES", 12)), deadline=None,
          suppress_health_check=list(HealthCheck))
def test_a_random_objective_is_not_equivalent_to_a_perturbed_copy(text, eps):
    obj = _random_objective(text)
    res = equivalence(obj, dataclasses.replace(obj, expr=_perturbed(obj.expr, eps)))
    assert not res["equivalent"] and res["numeric"]["differs"], text
    w = res["numeric"]["witness"]
    ga = w["gradients"][0]
    if ga is not None and w["gradients"][1] is not None:
        # the witness's gradients differ by exactly the perturbation's r·ε·A (rounding aside)
        assert w["gradients"][1] - ga == pytest.approx(eps * w["r"] * w["A"], rel=1e-6, abs=1e-9 * max(1, abs(ga)))


# ------------------------------------------------------------------ admissibility
# Derived by hand from each objective's w (the truth the report must match):
# surrogate  w = 1: w(1) = 1, bounded, both tails the constant 1, symmetric in log r.
# ppo        w = [r ≤ 1.2] for A > 0, [r ≥ 0.8] for A < 0: w(1) = 1, bounded in [0, 1]; as r → 0 w is 1
#            (A > 0) or cut to 0 (A < 0), as r → ∞ the reverse; not symmetric (w(1.25) = 0, w(0.8) = 1).
# spo        w = 1 − sign(A)(r − 1)/ε, ε = 0.2: w(1) = 1, unbounded; r → 0: 1 + sign(A)/ε = 6 or −4;
#            r → ∞: ∓r/ε grows with order 1 (to −∞ for A > 0, +∞ for A < 0); not symmetric.
# drpo       w = 1 − sign(A)(π − μ)/δ, δ = 12.5: w(1) = 1, bounded in [0.92, 1.08]; r → 0 (π → 0):
#            1 + sign(A)μ/δ, a constant from 1 to 1.08 (A > 0) or 0.92 to 1 (A < 0) with μ; along π = 1,
#            μ → 0: 1 − sign(A)/δ = 0.92 or 1.08; not symmetric.
# sapo       w = 4e^(−τx)/(1 + e^(−τx))², x = r − 1 (τ = 1 for A > 0, 1.05 otherwise): w(1) = 4/4 = 1,
#            bounded in [0, 1]; r → 0: 4e^τ/(1 + e^τ)² (0.786448, 0.768110); r → ∞: ~4e^(−τr), exponential.
# kl         w = 1 + sign(A)/(2δr), δ = 12.5: w(1) = 1 ± 0.04 ≠ 1; unbounded; r → 0 grows with order 1
#            (+∞ for A > 0, −∞ for A < 0); r → ∞ tends to 1; not symmetric.
CONST, CUT, EXP = "tends to a constant", "is 0 (cut off)", "decays exponentially"
ADMISSIBLE = [
    # name, w(1) = 1, bounded, (A>0: r→0, r→∞), (A<0: r→0, r→∞) as (kind, constant span or order), symmetric
    ("surrogate", True, True, ((CONST, (1, 1)), (CONST, (1, 1))), ((CONST, (1, 1)), (CONST, (1, 1))), True),
    ("ppo", True, True, ((CONST, (1, 1)), (CUT, None)), ((CUT, None), (CONST, (1, 1))), False),
    ("spo", True, False, ((CONST, (6, 6)), ("grows", 1)), ((CONST, (-4, -4)), ("grows", 1)), False),
    ("drpo", True, True, ((CONST, (1, 1.08)), (CONST, (0.92, 0.92))), ((CONST, (0.92, 1)), (CONST, (1.08, 1.08))),
     False),
    ("sapo", True, True, ((CONST, (0.786448, 0.786448)), (EXP, None)), ((CONST, (0.768110, 0.768110)), (EXP, None)),
     False),
    ("kl", False, False, (("grows", 1), (CONST, (1, 1))), (("grows", 1), (CONST, (1, 1))), False),
]


@pytest.mark.parametrize("name, at_one, bounded, pos, neg, symmetric", ADMISSIBLE, ids=[a[0] for a in ADMISSIBLE])
def test_the_admissibility_block_matches_the_hand_derivation(name, at_one, bounded, pos, neg, symmetric):
    out = to_json(analyze(dsl.load(name)))
    adm = json.loads(json.dumps(out["admissibility"]))       # it is JSON
    assert adm["w_at_1"]["value"] is at_one and adm["bounded"]["value"] is bounded
    for adv, (zero, infinity) in (("positive", pos), ("negative", neg)):
        for got, (kind, what) in ((adm["tails"]["by_sign"][adv]["zero"], zero),
                                  (adm["tails"]["by_sign"][adv]["infinity"], infinity)):
            assert got["kind"] == kind, (adv, got)
            if kind == CONST:
                assert got["value"] == pytest.approx(list(what), abs=1e-5), (adv, got)
            elif kind == "grows":
                assert got["order"] == [what, what], (adv, got)
    assert adm["symmetric_log_r"]["value"] is symmetric
    if not symmetric:   # the example is a true asymmetry, by sympy.diff (not the IR's derivative rules)
        x = next(b["example"] for b in adm["symmetric_log_r"]["by_sign"].values() if b["example"])
        truth = weight_function(dsl.load(name))
        w = [float(truth(np.array([r]), x["mu"], x["A"])[0]) for r in (x["r"], 1 / x["r"])]
        assert w == pytest.approx(x["w"], rel=1e-9) and abs(w[0] - w[1]) > 1e-6


@pytest.mark.parametrize("name, status", [("surrogate", "derived"), ("drpo", "derived"), ("kl", "numeric")])
def test_w_at_one_is_derived_where_sympy_shows_it(name, status):
    assert analyze(dsl.load(name))["admissibility"]["w_at_1"]["status"] == status


def test_the_report_has_the_admissibility_block():
    proc = _cli("spo")
    assert proc.returncode == 0, proc.stderr
    block = proc.stdout.split("  admissibility\n")[1]
    assert "w(1) = 1            yes, for both signs of A (derived" in block
    assert "bounded             no: w ∈ [-∞, +∞]" in block
    assert "tail r → 0          A > 0: tends to a constant, 6; A < 0: tends to a constant, -4" in block
    assert "tail r → 1/μ        A > 0: grows to −∞ (order 1); A < 0: grows to +∞ (order 1)" in block


# ------------------------------------------------------------------ beyond the uniform response (torch)
GSPO_REWRITE = ("@aggregate = seq-mean-token-mean\nε_low = 3e-4\nε_high = 4e-4\ns = exp(seq_mean(log(r)))\n"
                "min(A*s, A*clip(s, 1 - ε_low, 1 + ε_high))\n")
SEQUENCE_PAIRS = [
    # (a, b, the same on every response): --equiv compares them on a uniform response only, and says so
    ("gspo", GSPO_REWRITE, True),
    ("seq_mean(r)*A\n", "seq_sum(r)/seq_len*A\n", True),
    ("seq_mean(r)^2*A\n", "seq_mean(r^2)*A\n", False),     # r²·A on a uniform response; not elsewhere
]


@pytest.mark.parametrize("a, b, everywhere", SEQUENCE_PAIRS, ids=[f"{i}" for i in range(len(SEQUENCE_PAIRS))])
def test_sequence_equivalence_holds_on_the_uniform_response_it_states(a, b, everywhere):
    """--equiv says equivalent for each pair, on the uniform response; the compiled losses'
    gradients on random non-uniform responses show where that statement's scope matters."""
    torch = pytest.importorskip("torch")
    from openrlhf_drpo.hosts.openrlhf.loss import ObjectiveLoss
    oa, ob = _obj(a), _obj(b)
    res = equivalence(oa, ob, seq_len=4)
    assert res["equivalent"] and res["scope"]["sequence"], res["numeric"].get("witness")
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 2 - 0.05
    new = old + 0.02 * torch.randn(6, 9, generator=g, dtype=torch.float64)
    A = torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 9, generator=g) > 0.2
    grads = []
    for o in (oa, ob):
        lp = new.clone().requires_grad_()
        grads.append(torch.autograd.grad(ObjectiveLoss(o)(lp, old, A, action_mask=mask)[0], lp)[0])
    assert torch.allclose(grads[0], grads[1], rtol=1e-9, atol=1e-12) is everywhere


@pytest.mark.parametrize("a, b", [("icepop", "ppo"), ("tis_ppo", "ppo"), ("kpop", "ppo")])
def test_a_mismatch_factor_is_compared_over_rho_not_only_where_it_is_1(a, b):
    # at ρ = π_old/π_rollout = 1 (--rho's default) each factor is 1 and the two agree; the
    # rollout engine's mismatch is part of the domain, so they are not equivalent
    res = equivalence(dsl.load(a), dsl.load(b))
    assert not res["equivalent"] and res["numeric"]["witness"]["rho"] != 1.0
    assert res["numeric"]["rhos"] and 1.0 in res["numeric"]["rhos"]
    same = equivalence(dsl.load(a), dsl.load(a))
    assert same["equivalent"] and len(same["numeric"]["rhos"]) >= 7
