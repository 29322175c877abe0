"""drpo-analyze reproduces the paper's closed forms (Table 1, Appendices B and C)."""
import functools
import json
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import sympy as sp
from hypothesis import HealthCheck, event, given, settings
from extra_inputs import r_analysed
from strategies import POLICY_OBJECTIVES, RESEARCH_OBJECTIVES, SEQUENCE_OBJECTIVES, draws

import dsl
from openrlhf_drpo.analysis.orchestrator import analyze, self_check
from openrlhf_drpo.analysis.present.report import report, to_json
from openrlhf_drpo.analysis.present.summary import summary

r, mu, A = sp.symbols("r mu A")
S = sp.sign


def sym(text, params):
    return sp.sympify(text, locals={"r": r, "mu": mu, "A": A, **{k: sp.Symbol(k) for k in params}})


# name, overrides, closed-form w (params substituted), boundary π for A>0 and A<0, geometry,
# bounded, smooth, exact range (None where unbounded)
CLOSED_FORMS = [
    ("surrogate", {}, lambda p: sp.Integer(1), [], [], "none", True, True, (1, 1)),
    ("ppo", {}, None, ["6*mu/5"], ["4*mu/5"], "ratio", True, False, (0, 1)),
    ("grpo_clip_higher", {}, None, ["32*mu/25"], ["4*mu/5"], "ratio", True, False, (0, 1)),
    ("spo", {}, lambda p: 1 - S(A * (r - 1)) * sp.Abs(r - 1) / p["eps"], ["6*mu/5"], ["4*mu/5"],
     "ratio", False, True, (None, None)),
    ("dppo_binary_tv", {}, None, ["mu + 3/20"], ["mu - 3/20"], "binary-tv", True, False, (0, 1)),
    # at δ = 12.5 the A < 0 zero π = μ − 12.5 lies at r < 0: no boundary (the report's notes keep it)
    ("drpo", {}, lambda p: 1 - S(A * (r - 1)) * sp.Abs(mu * r - mu) / p["delta"], ["mu + 25/2"], [],
     "binary-tv", True, True, (1 - 1 / 12.5, 1 + 1 / 12.5)),
    ("drpo", {"delta": "0.5"}, lambda p: 1 - S(A * (r - 1)) * sp.Abs(mu * r - mu) / p["delta"],
     ["mu + 1/2"], ["mu - 1/2"], "binary-tv", True, True, (-1, 3)),
    ("kl", {}, lambda p: 1 + S(A) / (2 * p["delta"] * r), [], ["mu/25"], "ratio", False, True, (None, None)),
    ("k3", {}, lambda p: 1 - S(A) * (r - 1) / (2 * p["delta"] * r), [], ["mu/26"], "ratio", False, True, (None, None)),
    ("k3", {"delta": "0.2"}, lambda p: 1 - S(A) * (r - 1) / (2 * p["delta"] * r), ["5*mu/3"], ["5*mu/7"],
     "ratio", False, True, (None, None)),
    ("tv", {}, lambda p: 1 - S(A) * S(r - 1) / (2 * p["delta"]), [], [], "two-level", True, False, (0.96, 1.04)),
    ("kl_no_adv", {}, lambda p: 1 + 1 / (2 * p["delta"] * r * A), [], ["-mu/(25*A)"], "advantage-entangled",
     False, True, (None, None)),
]


def _random_points(n=300, seed=0):
    rng = np.random.default_rng(seed)
    mus = rng.uniform(0.01, 1, n)
    pis = rng.uniform(0.01, 1, n)
    As = rng.choice([-1, 1], n) * rng.uniform(0.1, 3, n)
    return pis / mus, mus, As


def _ppo_like(eps_low, eps_high):
    return lambda rr, mm, aa: np.where(aa > 0, (rr <= 1 + eps_high) * 1.0, (rr >= 1 - eps_low) * 1.0)


NUMERIC_W = {   # the piecewise-constant ones, as the paper states them: w ∈ {0, 1}
    "ppo": _ppo_like(0.2, 0.2),
    "grpo_clip_higher": _ppo_like(0.2, 0.28),
    "dppo_binary_tv": lambda rr, mm, aa: np.where(
        (aa * (rr - 1) > 0) & (np.abs(mm * rr - mm) > 0.15), 0.0, 1.0),
}


@pytest.mark.parametrize("name, overrides, w_closed, b_pos, b_neg, geometry, bounded, smooth, rng",
                         CLOSED_FORMS, ids=[f"{c[0]}{c[1] or ''}" for c in CLOSED_FORMS])
def test_analysis_reproduces_the_papers_closed_forms(name, overrides, w_closed, b_pos, b_neg, geometry,
                                                     bounded, smooth, rng):
    # without overrides, the shipped objective's analysis the other library tests read (_shipped)
    res = analyze(dsl.load(name, params=overrides)) if overrides else _shipped(name)
    out = to_json(res)
    params = {k: sp.Rational(str(v)) for k, v in out["params"].items()}
    w_json = sym(out["weight"], params).subs({sp.Symbol(k): v for k, v in params.items()})
    rr, mm, aa = _random_points()
    if w_closed is not None:
        # the vectorized weight and the printed formula, each against the paper's closed form
        closed = sp.lambdify([r, mu, A], w_closed(params), "numpy")(rr, mm, aa)
        printed = sp.lambdify([r, mu, A], w_json, "numpy")(rr, mm, aa)
        assert np.allclose(res.w(rr, mm, aa), np.broadcast_to(closed, rr.shape), atol=1e-9)
        assert np.allclose(np.broadcast_to(printed, rr.shape), np.broadcast_to(closed, rr.shape), atol=1e-9)
    else:
        assert np.array_equal(res.w(rr, mm, aa), NUMERIC_W[name](rr, mm, aa))
    for side, expected in (("positive", b_pos), ("negative", b_neg)):
        got = [sym(e, params) for e in out["boundary"][side]["pi"]]
        assert len(got) == len(expected), (side, out["boundary"][side])
        for e in expected:
            assert any(sp.simplify(g - sym(e, params)) == 0 for g in got), (side, e, got)
    assert out["geometry"] == geometry
    assert out["bounded"] is bounded and out["smooth"] is smooth
    lo, hi = rng
    assert (out["weight_range"][0] is None) == (lo is None) and (out["weight_range"][1] is None) == (hi is None)
    if lo is not None:
        assert out["weight_range"] == pytest.approx([lo, hi], abs=1e-9)
    assert out["self_check"]["passed"]


def test_drpo_at_the_papers_delta_warns_that_its_boundary_is_unreachable():
    out = to_json(_shipped("drpo"))
    assert out["reachable"] == {"positive": False, "negative": False}
    assert out["weight_range"] == [0.92, 1.08]
    unreachable = [w for w in out["warnings"] if "unreachable" in w]
    assert len(unreachable) == 1
    assert "π = μ + 12.5" in unreachable[0] and "never cancels the gradient" in unreachable[0]   # (the range: its own line)
    # the A < 0 zero π = μ − 12.5 is at r < 0: no boundary there, and the notes say why
    assert out["boundary"]["negative"]["pi"] == []
    assert any("r = 1 − 25/(2·μ)" in n and "r ≤ 0" in n for n in out["notes"])
    small = to_json(analyze(dsl.load("drpo", params={"δ": "0.2"})))
    assert small["reachable"] == {"positive": True, "negative": True}
    assert not [w for w in small["warnings"] if "unreachable" in w]


def test_k3_has_a_positive_boundary_only_below_half():
    assert to_json(analyze(dsl.load("k3", params={"delta": "0.49"})))["boundary"]["positive"]["r"] == ["50"]
    assert to_json(analyze(dsl.load("k3", params={"delta": "0.5"})))["boundary"]["positive"]["r"] == []


def test_dual_clip_cuts_negative_advantages_at_c():
    out = to_json(_shipped("ppo_dual_clip"))
    assert sorted(out["boundary"]["negative"]["r"]) == ["3", "4/5"]
    assert out["boundary"]["positive"]["r"] == ["6/5"]


@functools.lru_cache(maxsize=None)
def _shipped(name):
    """A shipped objective's analysis, computed once per test process (the library's tests read it)."""
    return analyze(dsl.load(name))


def _shipped_json(name) -> str:
    return json.dumps(to_json(_shipped(name)), sort_keys=True)


# a report whose worry names the held point, which is what it is about (passk_max was one, until its
# w was taken against its own advantage Â = best: PPO's clip, whatever the held group)
DEGENERATE: set = set()


@pytest.mark.parametrize("name", r_analysed(dsl.shipped_names()))
def test_every_shipped_report_opens_with_a_summary_that_fits_a_screen_in_a_researchers_words(name):
    lines = report(_shipped(name)).splitlines()
    head = lines[:lines.index("evidence")]
    assert len(head) <= 40 and max(map(len, lines)) <= 100, (len(head), max(map(len, lines)))
    labels = [line.split()[0] for line in head if line.startswith("  ") and not line.startswith("   ")]
    assert [x for x in labels if x in ("gradient", "trust", "bounded", "worry")] == \
        ["gradient", "trust", "bounded", "worry"], labels
    said = " ".join(head)
    if name in DEGENERATE:      # its worry about the held point, and the claims it qualifies
        said = re.sub(r"at this held point only: .*?a property of the held point, not of the objective|"
                      r"\(held point only\)", "", said)
    assert not re.search(r"\b(arbiter|third version|held)\b", said), head
    assert head[0].startswith(f"{name} — ") and "Source:" not in head[0]


def _ranges_at_levels(lines):
    """{range as printed: the evidence levels it is stated at} over a first screen's unwrapped
    lines: each [lo, hi] with the first status in parentheses after it on its line."""
    out = {}
    for line in lines:
        for m in re.finditer(r"\[[^\[\]]+, [^\[\]]+\]", line):
            level = re.search(r"\((proven|found|unconfirmed|held point only)\b", line[m.end():])
            if level:
                out.setdefault(m.group(), set()).add(level.group(1))
    return out


@pytest.mark.parametrize("name", r_analysed(dsl.shipped_names()))
def test_the_first_screen_never_states_one_range_at_two_evidence_levels(name):
    # issue 47: drpo's 'bounded yes: w ∈ [0.92, 1.08] (unconfirmed)', then 'w stays within [0.92, 1.08]
    # ... (proven)' two lines down
    levels = _ranges_at_levels(summary(_shipped(name), width=None))
    assert all(len(v) == 1 for v in levels.values()), levels


def test_the_evidence_level_check_reads_a_range_stated_twice():
    lines = ["  bounded       yes: w ∈ [0.92, 1.08] (unconfirmed)",
             "  worry         ! the boundary ... so w stays within [0.92, 1.08] and never cancels (proven)"]
    assert _ranges_at_levels(lines) == {"[0.92, 1.08]": {"unconfirmed", "proven"}}


@pytest.mark.parametrize("name", sorted(set(dsl.shipped_names()) - set(r_analysed(dsl.shipped_names()))))
def test_every_shipped_vocabulary_objective_is_refused_by_the_analysis_at_its_first_sum(name):
    obj = dsl.load(name)
    with pytest.raises(dsl.DslError) as e:
        analyze(obj)
    assert (e.value.line, e.value.col) == min((n.pos.line, n.pos.col) for n in obj.facts.vocabulary)
    assert e.value.message.startswith("the r-analysis does not apply to the vocabulary sum"), e.value.render()


# OTB's ∂ℓ/∂r on the uniform batch, its baseline written out, is past SymPy's budget: its report
# says the weight is not derived and every finding is the arbiter's; the test holds it to that.
PROVISIONAL = {"otb": "not derived"}
# geo_mask's w = 1/r inside [0.1, 10] reaches its supremum 10 at the closed edge r = 0.1, between the
# points where the derived range is sampled (9.974 at the nearest): the report shows the arbiter's
# range and says the two disagree. The test holds it to that, so a sampling that finds the edge fails it.
RANGE_NUMERIC = {"geo_mask": [0.0, 10.0]}


@pytest.mark.parametrize("name", r_analysed(dsl.shipped_names()))
def test_every_shipped_objective_has_every_json_key_and_passes_its_self_check(name):
    out = json.loads(_shipped_json(name))
    assert set(out) >= {"name", "params", "objective", "weight", "cases", "boundary", "reachable",
                        "weight_range", "bounded", "smooth", "geometry", "warnings"}
    assert out["name"] == name and all(k.isascii() for k in out["params"])
    if name in PROVISIONAL:
        assert out["self_check"]["passed"] and out["arbiter"]["weight"]["status"] == PROVISIONAL[name]
        assert out["scope"]["held"] and out["arbiter"]["range"] == "confirmed"
        for side in ("positive", "negative"):      # a boundary only found is said to be so
            assert out["boundary"][side]["numeric"] and out["claims"]["boundary"][side]["status"] == "found"
        assert bool(out["cases"]) == (PROVISIONAL[name] == "confirmed")
        return
    assert [(c["advantage"], c["direction"]) for c in out["cases"]] == [
        ("positive", "diverging"), ("positive", "converging"), ("negative", "diverging"), ("negative", "converging")]
    params = out["params"]
    for c in out["cases"]:
        sym(c["weight"], params)            # every formula reads back with sympify
    sym(out["weight"], params)
    assert set(out["boundary"]) == {"positive", "negative"}
    for side in out["boundary"].values():
        assert set(side) == {"r", "pi", "kind", "reachable", "numeric", "where"}
        assert len(side["r"]) == len(side["pi"]) == len(side["kind"]) == len(side["reachable"]) == len(side["where"])
        assert side["numeric"] == []        # every boundary of the library is derived, not only found
        for e in side["r"] + side["pi"]:
            sym(e, params)
    assert set(out["reachable"]) == {"positive", "negative"}
    claims = out["claims"]      # every claim says how it is known, and on what
    for c in [*claims["boundary"].values(), *sum(claims["reachable"].values(), []), claims["smooth"], claims["bounded"]]:
        assert c["status"] in ("proven", "found", "unconfirmed") + ("held point only",) * (name in DEGENERATE) \
            and c["evidence"], c
    assert len(out["weight_range"]) == 2
    assert out["geometry"] in ("none", "ratio", "binary-tv", "two-level", "advantage-entangled", "other")
    assert out["self_check"]["passed"] and out["self_check"]["points"] >= 32
    arb = out["arbiter"]
    if name in RANGE_NUMERIC:
        assert arb["range"] == "disagrees" and out["weight_range"] == pytest.approx(RANGE_NUMERIC[name], abs=1e-9)
        assert "the derived range disagreed with the numeric check" in json.dumps(out["warnings"], ensure_ascii=False)
        arb = {**arb, "range": "confirmed"}
    assert (arb["weight"]["status"], arb["boundary"], arb["range"]) == ("confirmed",) * 3, arb


def test_self_check_fails_on_a_wrong_weight():
    obj = dsl.load("drpo")
    wrong = lambda rr, mm, aa: np.ones_like(np.asarray(rr, dtype=float))  # the surrogate's w, not DRPO's
    assert not self_check(obj, wrong)["passed"]
    right = analyze(obj).w
    assert self_check(obj, right)["passed"]


def test_a_step_past_its_work_budget_falls_back_and_says_so(monkeypatch):
    import openrlhf_drpo.analysis.budgets as budgets
    monkeypatch.setitem(budgets.BUDGET, "simplify", 0)
    res = analyze(dsl.load("drpo"))
    assert any(n.startswith("w at r = 1: ") and "past the work budget of 0" in n for n in res.notes), res.notes
    assert res.admissibility["w_at_1"]["status"] == "numeric"        # the fallback: not derived
    assert res.weight is not None and res.self_check["passed"] and not res.hang_guard["fired"]


def test_past_the_settling_budget_the_report_is_the_arbiters_and_says_so(monkeypatch):
    # conditions left as built cost seconds to print and evaluate: the report is the arbiter's
    import openrlhf_drpo.analysis.budgets as budgets
    monkeypatch.setitem(budgets.BUDGET, "settle", 1)
    res = analyze(dsl.load("ppo"))
    assert res.weight is None and any("settling one case's conditions took" in n and "numeric check" in n
                                         for n in res.notes), res.notes
    assert not res.hang_guard["fired"]


def test_past_the_branch_budget_the_report_is_the_arbiters_and_says_so(monkeypatch):
    import openrlhf_drpo.analysis.budgets as budgets
    monkeypatch.setitem(budgets.BUDGET, "branches", 5)
    out = to_json(analyze(dsl.load("ppo")))        # 6 branch points
    assert out["weight"] == "None" and out["cases"] == []
    assert any("branch points" in n and "numeric check" in n for n in out["notes"]), out["notes"]


def test_the_hang_guard_is_reported_when_it_fires(monkeypatch):
    import openrlhf_drpo.analysis.budgets as budgets
    from openrlhf_drpo.analysis.present.report import report
    monkeypatch.setattr(budgets, "HANG_SECONDS", 1e-3)
    res = analyze(dsl.load("gmpo"))
    out = to_json(res)
    assert out["hang_guard"] == {"seconds": 1e-3, "fired": True}
    assert out["weight"] == "None" and out["self_check"]["passed"]
    assert any("the hang guard fired" in n for n in out["notes"]), out["notes"]
    assert "the hang guard fired" in report(res)


def test_the_hang_guard_never_fires_on_the_library():
    for name in ("gmpo", "kpop", "bandpo_chi2", "vespo"):     # the slowest four (their analyses computed once)
        assert to_json(_shipped(name))["hang_guard"] == {"seconds": 20.0, "fired": False}


_JSON_OF = """
import json, sys
import dsl
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.present.report import to_json
print(json.dumps({n: json.dumps(to_json(analyze(dsl.load(n))), sort_keys=True) for n in sys.argv[1:]}))
"""


def test_every_shipped_objective_gives_byte_identical_json_under_load_and_in_another_process():
    """Budgets count work, never seconds: the JSON computed while busy loops hog every core (and
    in another process, whose string hashes differ) is the JSON computed quietly, byte for byte."""
    import os
    names = r_analysed(dsl.shipped_names())
    quiet = {n: _shipped_json(n) for n in names}
    # one busy loop per core: the analysis then gets a fraction of a core, as beside a training run
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        proc = subprocess.run([sys.executable, "-c", _JSON_OF, *names], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": "4242"}, timeout=900)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr[-3000:]       # nothing but the analysis: no NumPy or SymPy warning
    loaded = json.loads(proc.stdout)
    for n in names:
        assert loaded[n] == quiet[n], n


# Objectives whose report once printed SymPy's own calls (a weight as Piecewise(...), a boundary
# as Eq(...)): tight budgets force each fallback there is.
RAW_SYMPY = ["gmpo", "vespo", "bandpo_tv", "min(r*A, clip(r, 1 - 0.2*μ, 1 + 0.3)*A)",
             "r*A - |A|*exp(r)/10", "[r != 1.5]*exp(A*(r - 1))", "2*min(r*A, clip(r, 0.8, 1.2)*A)*[r > 0.5]"]


@pytest.mark.parametrize("tight", [False, True], ids=["budgets", "tight budgets"])
@pytest.mark.parametrize("spec", RAW_SYMPY)
def test_no_weight_or_boundary_is_printed_as_a_sympy_call(spec, tight, monkeypatch):
    import openrlhf_drpo.analysis.budgets as budgets
    from openrlhf_drpo.analysis.present.report import report
    if tight:
        for key in ("settle", "tidy", "limit"):
            monkeypatch.setitem(budgets.BUDGET, key, 0)
    res = analyze(dsl.load(spec) if "*" not in spec else dsl.parse(spec + "\n"))
    text = to_json(res)["text"]
    shown = [report(res), text["weight"] or "", *text["cases"],
             *(e for b in text["boundary"].values() for e in b["r"] + b["pi"])]
    for s in shown:
        assert "Eq(" not in s and "Piecewise(" not in s and "ITE(" not in s, s


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "openrlhf_drpo.cli", *args], capture_output=True, text=True)


def test_cli_report_and_comparison_table():
    proc = _cli("drpo", "ppo", "spo")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "drpo — DRPO: Divergence Regularized Policy Optimization" in out
    assert "w = 1 + μ·(1 − r)·sign(A)/δ" in out
    lines = out.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("objective "))]
    table = lines[lines.index(table):]
    assert table[0].split()[:3] == ["objective", "w", "range"]
    rows = [line for line in table[2:] if not line.startswith(" ")]     # a wrapped cell continues below
    assert [line.split()[0] for line in rows] == ["drpo", "ppo", "spo"] and max(map(len, table)) <= 100
    assert "binary-tv" in rows[0] and "ratio" in rows[1] and "[-∞, +∞]" in rows[2]
    assert table[3].split() == ["(unreachable)"]        # drpo's boundary for A > 0, on its row's second line


def test_cli_json_for_several_objectives_is_a_list_and_set_applies_by_name():
    proc = _cli("k3", "drpo", "--json", "--set", "delta=0.2")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [d["name"] for d in data] == ["k3", "drpo"]
    assert data[0]["boundary"]["positive"]["r"] == ["5/3"]
    assert data[1]["params"] == {"delta": 0.2}


def test_cli_unknown_set_name_is_a_located_error():
    proc = _cli("drpo", "--set", "epsilon=0.1")
    assert proc.returncode == 1
    assert proc.stderr.startswith("--set:1:1: error: unknown parameter 'epsilon' for objective 'drpo'")


def test_plot_writes_a_png_of_the_right_size(tmp_path):
    path = tmp_path / "w.png"
    proc = _cli("drpo", "ppo", "--plot", str(path))
    assert proc.returncode == 0, proc.stderr
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1000, 800)


def test_drpo_analyze_never_imports_torch():
    code = ("import sys; from openrlhf_drpo.cli import analyze_main; analyze_main(['drpo', 'ppo', '--json']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(POLICY_OBJECTIVES)
def test_any_objective_is_analysed_without_error_and_passes_its_self_check(text):
    out = to_json(analyze(dsl.parse(f"δ = 0.3\n{text}")))      # depends on the policy by construction
    json.dumps(out)
    # never a failed self-check; "unconfirmed" only where too few points had a finite value
    assert out["self_check"]["status"] != "failed", (text, out["self_check"])
    assert out["self_check"]["passed"] == (out["self_check"]["points"] >= 32), (text, out["self_check"])
    event(f"self-check {out['self_check']['status']}")


def test_the_random_objective_strategies_write_only_objectives_the_parser_accepts():
    # so the fuzz tests filter nothing for want of the policy (before issue 31: 40% to 60%)
    for strategy in (POLICY_OBJECTIVES, SEQUENCE_OBJECTIVES, RESEARCH_OBJECTIVES):
        for text in draws(strategy, 150):
            dsl.parse(f"δ = 0.3\n{text}")


# Valid objectives that used to end in an internal error (issue 8), each with what the report
# must now say about it. What each should say in full is the analysis issue's to settle.
NO_INTERNAL_ERROR = [
    ("sqrt(1 - r)*A", "self-check passed"),                         # imaginary for r > 1
    ("r*A*1e200*1e200", "w ∈ unknown"),                             # w = 1e400: no double holds it
    ("τ = 1\n4/τ * A / (1 + exp(-τ*(r - 1)))", "self-check passed"),  # SAPO's gate, written with exp
    ("exp(r)*A", "self-check passed"),                              # E has a numeric value
    ("δ = 0.2\n(log(1 + (clip([0.5 >= δ]*A, max(A, π), r - π))^2))^2", "self-check"),   # Min over zoo
    ("(log(1 + (clip(r/(1 + r^2), [μ >= A]*A, r/(1 + A^2)))^2))^2", "self-check"),       # ITE in w
    # merging equal pieces ran past the settling budget outside its fallback (found by Hypothesis)
    ("|clip((2)/(1 + (r)^2), max(2, A), [not (not (π != π * μ))]*(π))|", "settling one case's conditions took"),
]


@pytest.mark.parametrize("text, says", NO_INTERNAL_ERROR)
def test_valid_objectives_never_end_in_an_internal_error(text, says, tmp_path):
    path = tmp_path / "mine.dsl"
    path.write_text(text + "\n")
    proc = subprocess.run([sys.executable, "-m", "openrlhf_drpo.cli", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    assert says in proc.stdout


# The on-policy weight, derived by hand: w = (∂ℓ/∂r)/A at r = 1 (π = μ), for A > 0 and A < 0.
ON_POLICY = [
    ("r*A", "ok", (1, 1)),
    ("r*A - |A|/(2*0.2)*μ*(r - 1)^2", "ok", (1, 1)),        # DRPO: the penalty's slope is 0 at r = 1
    ("A*r^2/2", "ok", (1, 1)),                              # w = r
    ("μ*r*A", "ok", (1e-6, 1)),                             # w = μ: as small as the rarest token
    ("log(r - 0.5)*A", "ok", (2, 2)),                       # w = 1/(r - 1/2)
    ("-r*A", "negative", (-1, -1)),
    ("[r != 1]*r*A", "zero", (0, 0)),                       # the indicator is 0 exactly on policy
    ("(r - 1)^3*A", "zero", (0, 0)),                        # w = 3(r - 1)^2
    ("A*(r^2 - 1)/(r - 1)", "undefined", (None, None)),     # 0/0: NaN in the compiled loss
    ("sqrt(1 - r)*A", "undefined", (None, None)),           # w = -1/(2√(1 - r)): a pole at r = 1
]


@pytest.mark.parametrize("text, status, w", ON_POLICY)
def test_the_on_policy_weight_is_reported_for_each_sign_of_a(text, status, w):
    from openrlhf_drpo.analysis.numeric.extremes import on_policy
    from dsl.walks import derivative
    obj = dsl.parse(text + "\n")
    facts = on_policy(obj, derivative(obj.expr))
    for adv in ("positive", "negative"):
        assert facts[adv]["status"] == status
        assert facts[adv]["w"] == pytest.approx(list(w)) if w[0] is not None else facts[adv]["w"] == [None, None]


@pytest.mark.parametrize("name", ["E", "I", "N", "S", "O", "Q", "beta", "gamma", "zeta"])
def test_json_formulas_read_back_with_sympify_for_names_sympy_treats_specially(name, tmp_path):
    path = tmp_path / "special.dsl"
    path.write_text(f"{name} = 0.2\nμ_c = 0.5\nmin(r*A, clip(r, 1 - {name}, 1 + {name})*A) - |A|/(2*{name})*(r-1)^2 "
                    f"+ [μ > μ_c]*A*r\n")
    res = analyze(dsl.load(str(path)))
    out = to_json(res)
    names = {n: sp.Symbol(n) for n in out["symbols"]}
    values = {names[k]: v for k, v in out["params"].items()}
    rr, mm, aa = _random_points(50)
    for text in [out["weight"]] + [c["weight"] for c in out["cases"]]:
        e = sp.sympify(text, locals=names).subs(values)
        assert e.free_symbols <= {names["r"], names["mu"], names["A"]}, text
    w = sp.lambdify([names["r"], names["mu"], names["A"]], sp.sympify(out["weight"], locals=names).subs(values))
    assert np.allclose(np.broadcast_to(w(rr, mm, aa), rr.shape), res.w(rr, mm, aa))
    for side in out["boundary"].values():
        for text in side["r"] + side["pi"]:
            assert sp.sympify(text, locals=names).subs(values).free_symbols <= {names["mu"], names["A"]}


# SAPO-like gates built from the smooth atoms, τ = 1 for A > 0 and 1.05 otherwise (as sapo.dsl),
# each scaled so that w(1) = 1. By hand, with x = τ(r − 1):
#   erf:      ℓ = (√π/2)/τ·erf(x)·A    w = e^(−x²)            (√π/2 = 0.886226925452758, to 1e-16)
#   atan:     ℓ = atan(x)/τ·A          w = 1/(1 + x²)
#   softsign: ℓ = softsign(x)/τ·A      w = 1/(1 + |x|)²
# Each w is in (0, 1], 1 only at r = 1, never 0 (no boundary), smooth; the range's closure [0, 1]
# is exact: 0 is the limit r → ∞ (μ → 0), where erf's w decays like e^(−τ²r²) and the others like 1/(τr)².
GATE = "τ_pos = 1.0\nτ_neg = 1.05\nτ = [A > 0]*τ_pos + [A <= 0]*τ_neg\n"
GATES = [
    ("0.886226925452758/τ*erf(τ*(r - 1))*A", lambda t: sp.exp(-(t * (r - 1)) ** 2), None),
    ("atan(τ*(r - 1))/τ*A", lambda t: 1 / (1 + (t * (r - 1)) ** 2), 2),
    ("softsign(τ*(r - 1))/τ*A", lambda t: 1 / (1 + t * sp.Abs(r - 1)) ** 2, 2),
]


@pytest.mark.parametrize("text, w_closed, tail_order", GATES, ids=["erf", "atan", "softsign"])
def test_smooth_atom_gates_have_the_hand_derived_weight_range_and_tails(text, w_closed, tail_order):
    res = analyze(dsl.parse(GATE + text))
    out = to_json(res)
    rr, mm, aa = _random_points()
    expected = np.where(aa > 0, sp.lambdify(r, w_closed(1))(rr), sp.lambdify(r, w_closed(sp.Rational(21, 20)))(rr))
    assert np.allclose(res.w(rr, mm, aa), expected, rtol=1e-12, atol=0)
    assert out["on_policy"]["positive"]["w"] == pytest.approx([1, 1]) == out["on_policy"]["negative"]["w"]
    assert all(not out["boundary"][side]["r"] and not out["boundary"][side]["numeric"] for side in out["boundary"])
    assert out["weight_range"] == [0, 1] and out["bounded"] and out["smooth"]
    assert not any("range is numeric" in w for w in out["warnings"])
    assert out["arbiter"]["weight"]["status"] == "confirmed" and out["self_check"]["passed"]
    # the tails, on the derived weight of each case far from r = 1: w·r^k → a nonzero constant
    # at k = the polynomial order, → 0 for every k where w decays exponentially
    for case in out["cases"]:
        if (case["direction"] == "diverging") != (case["advantage"] == "positive"):
            continue        # the case r < 1: bounded away from 0 on (0, 1)
        w = sym(case["weight"], {})
        if tail_order is None:
            assert sp.limit(w * r ** 20, r, sp.oo) == 0
        else:
            assert sp.limit(w * r ** tail_order, r, sp.oo).is_positive


# The report's formulas, by hand: SymPy's constant π (from erf's derivative 2/√π·e^(−x²)) is a
# decimal, never the letter the language uses for the probability; r**2/400 is r²/400.
REPORT_TEXT = [
    ("erf(r - 1)*A", "1.12838·exp(-r^2 + 2·r − 1)"),                       # 2/√π = 1.1283791...
    ("0.886226925452758*erf(r - 1)*A", "exp(-r^2 + 2·r − 1)"),             # (√π/2)·(2/√π) = 1 to 1e-16
    ("erf(1.05*(r - 1))*A", "1.1848·exp(-441·r^2/400 + 441·r/200 − 1.1025)"),   # 1.05·2/√π; 1.05² = 441/400
    ("atan(2*(r - 1))/2*A", "1/(4·r^2 − 8·r + 5)"),
]


@pytest.mark.parametrize("text, shown", REPORT_TEXT)
def test_the_report_prints_constants_as_numbers_and_exponents_whole(text, shown):
    from openrlhf_drpo.analysis.mathtext import math_text
    assert math_text(analyze(dsl.parse(text + "\n")).weight, weight=True) == shown


# Conditions as a person writes them (issue 19): in r, thresholds in μ settled over 0 < μ ≤ 1,
# regions that are empty there dropped (exactly: thresholds linear in μ or 1/μ keep one order),
# and the one-line w without (A > 0) and ((A > 0) or (r > 1)).
READABLE = [
    # value 2 needs r ≤ 1 + μ/10 and r ≤ 1.3: the first implies the second
    ("min(r*A, clip(r, 1 - 0.2*μ, 1.3)*A) + min(r*A, clip(r, 0.7, 1 + 0.1*μ)*A)", 0,
     "2 if r ≤ μ/10 + 1; 1 if r ≤ 1.3; 0 otherwise"),
    ("min(r*A, clip(r, 1 - 0.2*μ, 1 + 0.3)*A)", 2, "1 if r ≥ 1 − μ/5; 0 otherwise"),
    ("min(r*A, clip(r, 1 - 0.2, 1 + 0.2*μ)*A)", 0, "1 if r ≤ μ/5 + 1; 0 otherwise"),
    # A > 0, r > 1: min(r, 1 + μ) ≤ 2 < 3, so max(…, 3)·A has w = 0 (r ≥ 3 with r ≤ 1 + μ is empty)
    ("max(min(r*A, clip(r, 0.8, 1 + μ)*A), 3*A)", 0, "0"),
    ("[1/μ >= 10 and r < 1.5]*r*A", 0, "1 if (μ ≤ 0.1) and (r < 1.5); 0 otherwise"),
]


@pytest.mark.parametrize("text, case, shown", READABLE)
def test_conditions_read_as_a_person_writes_them(text, case, shown):
    from openrlhf_drpo.analysis.mathtext import math_text
    res = analyze(dsl.parse(text + "\n"))
    assert math_text(res.cases[case]["weight"], weight=True) == shown
    assert res.arbiter["weight"]["status"] == "confirmed" and res.self_check["passed"]


@pytest.mark.parametrize("name, shown", [("sapo_atan", "1/(r^2 − 2·r + 2) if A > 0; "),
                                         ("topr", "1/r if A > 0; 1 if r < 1; 1/r otherwise"),
                                         ("kpop", "(1 if r ≤ 1.2; 0 otherwise) if (A > 0) and (r > 1); ")])
def test_the_one_line_weight_has_no_redundant_conditions(name, shown):
    from openrlhf_drpo.analysis.mathtext import math_text
    text = math_text(analyze(dsl.load(name)).weight, weight=True)
    assert text.startswith(shown) and "(A > 0) or (r > 1)" not in text, text


def test_a_mismatch_objective_linear_in_r_is_analysed_over_rho_not_stopped_by_a_scalar_weight():
    """w = 1/A is one number per sign: the ρ grid's range still reads it (Hypothesis found the crash)."""
    out = to_json(analyze(dsl.parse("pi_rollout + seq_mean(r)", "linear.dsl")))
    assert out["scope"]["mismatch_range"]["w"] == [-1.0, 1.0]
    assert out["scope"]["mismatch_range"]["kept"] == [0.0001, 10000.0]
