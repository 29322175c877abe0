"""What the analysis holds, and what it says of it (issue 36 item 6): a held group a researcher
recognizes (binary rewards with a spread, settable from the API and the command line) on which a
group-normalized advantage is not 0; a degenerate held point said so, never 'proven'; a group
reduction of A, which is position by position, warned of in the report and when the loss is
built; the reference terms in a channel of their own, and channel formulas in the parameters'
names. The gradient checks are autograd through CompiledLoss's plain path on a real group."""
import json
import math
import warnings

import numpy as np
import pytest
import torch

import dsl
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.present.report import report, to_json
from openrlhf_drpo.cli import analyze_main
from openrlhf_drpo.core import CompiledLoss

# GRPO's group-normalized advantage written in the file: (R − mean)/(std + ε) over the group's responses
GN = ("adv = (seq_mean(A) - group_mean(seq_mean(A)))/(group_std(seq_mean(A)) + 1e-6)\n"
      "min(r*adv, clip(r, 0.8, 1.2)*adv)")


def normalized(c):
    """The token's (the first response's) normalized advantage per unit of A on a group whose
    advantages are A·c, by NumPy's sample std: an oracle that shares no code with the analysis."""
    c = np.asarray(c, dtype=float)
    return (c[0] - c.mean()) / (c.std(ddof=1) + 1e-6)


def kinds(res):
    return [a.kind for a in res.warnings]


def test_a_group_normalized_advantage_is_analysed_on_a_group_with_a_spread():
    """The default group is binary rewards with a spread (half scoring A, half 0): PPO's clip
    boundaries show, and w on policy is the normalized advantage per unit of A, not 0."""
    # w against the host's A (own_advantage=False): the held group's machinery; against Â, Â's value there
    assert float(analyze(dsl.parse(GN, "gn.dsl")).advantage["at"](1.0)) == pytest.approx(
        normalized([1, 1, 1, 1, 0, 0, 0, 0]), rel=1e-9)
    res = analyze(dsl.parse(GN, "gn.dsl"), own_advantage=False)
    out = to_json(res)
    assert out["text"]["boundary"]["positive"]["r"] == ["1.2"] and out["text"]["boundary"]["negative"]["r"] == ["0.8"]
    assert "no gradient" not in kinds(res) and "degenerate held point" not in kinds(res)
    assert math.isclose(float(np.asarray(res.w(1.0, 0.5, 1.0))), normalized([1, 1, 1, 1, 0, 0, 0, 0]), rel_tol=1e-9)
    assert any("their advantages are A·(1, 1, 1, 1, 0, 0, 0, 0)" in h["text"] for h in out["scope"]["held"])


# a reduction inside another: the centred value's std reads the group's mean, one value for the group
NESTED = ("R = seq_mean(A)\nc = R - group_mean(R)\nadv = c/(group_std(c) + 0.1)\n"
          "min(r*adv, clip(r, 0.8, 1.2)*adv) + 0.5*group_mean(exp(c))*log(r)")


@pytest.mark.parametrize("text", [GN, NESTED], ids=["normalized", "nested"])
@pytest.mark.parametrize("log_r, A", [(0.1, 0.7), (0.35, 0.7), (0.1, -0.7), (-0.35, -0.7), (-0.1, 1.3)])
def test_on_a_group_with_the_held_advantages_the_tokens_gradient_is_the_derived_weight(text, log_r, A):
    """A group of 4 responses of 3 tokens with advantages A·(1, 1, 0, 0) (the default for G = 4),
    all sharing log π and log μ: autograd's ∂loss/∂log π at the first response's tokens is
    w·r·A/n, w from the analysis at that held group."""
    obj = dsl.parse(text, "gn.dsl")
    c = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    old = torch.full((4, 3), -1.3, dtype=torch.float64)
    logp = (old + log_r).requires_grad_()
    advantages = (A * c)[:, None].expand(4, 3)
    mask = torch.ones(4, 3, dtype=torch.bool)
    loss, _ = CompiledLoss(obj, fused=False)(logp, old, advantages, mask, groups=torch.zeros(4, dtype=torch.long))
    (grad,) = torch.autograd.grad(loss, logp)
    res = analyze(obj, group_size=4)
    r, mu = math.exp(log_r), math.exp(-1.3)
    # against the objective's own advantage Â where it builds one (GN's adv): w·r·Â
    a = float(res.advantage["at"](A)) if res.advantage else A
    expected = float(np.asarray(res.w(r, mu, a))) * r * a
    assert torch.allclose(-12 * grad[0], torch.full((3,), expected, dtype=torch.float64), rtol=1e-9, atol=1e-15)


def test_the_held_group_is_set_from_the_api_and_the_command_line(tmp_path, capsys):
    res = analyze(dsl.parse(GN, "gn.dsl"), group=(1, 0), own_advantage=False)
    assert math.isclose(float(np.asarray(res.w(1.0, 0.5, 1.0))), normalized([1, 0]), rel_tol=1e-9)
    path = tmp_path / "gn.dsl"
    path.write_text(GN + "\n")
    assert analyze_main(["--group", "1,0,0", "--json", str(path)]) == 0
    advantage = json.loads(capsys.readouterr().out)["advantage"]       # GN's adv is its own advantage Â
    assert advantage["group"] == [1.0, 0.0, 0.0] and "A·(1, 0, 0)" in advantage["text"]


@pytest.mark.parametrize("argv, said", [
    (["--group", "0,1"], "the first response is the analysed token's"),
    (["--group", "1,x"], "write decimal numbers separated by commas"),
    (["--group", "1,0", "--group-size", "3"], "--group has 2 responses but --group-size is 3"),
    (["--group", "1,1e400"], "entry 2 is past the largest double"),
    (["--group", "1,0,-1e309"], "entry 3 is past the largest double"),
    (["--group", "1,inf"], "write decimal numbers separated by commas"),
])
def test_a_held_group_that_cannot_be_held_is_refused_by_name(argv, said, tmp_path, capsys):
    path = tmp_path / "gn.dsl"
    path.write_text(GN + "\n")
    with pytest.raises(SystemExit) as exit_:
        analyze_main(argv + [str(path)])
    err = capsys.readouterr().err
    assert exit_.value.code != 0 and said in err and "Traceback" not in err and "internal error" not in err


def test_a_held_group_past_the_largest_double_is_refused_from_the_api():
    with pytest.raises(ValueError, match="entry 2 is past the largest double"):
        analyze(dsl.parse(GN, "gn.dsl"), group=(1, 10 ** 400))


def test_a_degenerate_held_point_is_said_and_its_zero_weight_never_proven():
    """On equal responses the normalized advantage is 0 by the group, not by ℓ: the report says
    the held point is degenerate, and no claim of no gradient is 'proven'."""
    res = analyze(dsl.parse(GN, "gn.dsl"), group=(1, 1, 1, 1), own_advantage=False)
    assert "no gradient" not in kinds(res) and kinds(res).count("degenerate held point") == 2
    assert {res.claims["boundary"][adv]["status"] for adv in ("positive", "negative")} == {"held point only"}
    text = report(res, width=None)
    worries = text.split("\n  worry ")[1].split("\nevidence")[0]      # the warnings, in the summary
    assert "the held point is degenerate for A > 0 and A < 0" in text and "(proven" not in worries


# a mask past every r the old sampling of the moved point tried, and a DAPO-style filter of equal groups
MASKED = "r*(A - group_mean(seq_mean(A)))*[r > 3]"
DAPO = ("R = seq_mean(A)\ns = group_std(R)\n"
        "[s > 0]*min(r*(R - group_mean(R))/s, clip(r, 0.8, 1.28)*(R - group_mean(R))/s)")


def claim_statuses(out):
    """Every status a claim carries in the JSON report: the claims' and the admissibility's."""
    claims = out["claims"]
    return ([claims["boundary"][adv]["status"] for adv in ("positive", "negative")]
            + [claims[k]["status"] for k in ("bounded", "smooth")]
            + [out["admissibility"][k]["status"] for k in ("w_at_1", "bounded", "tails", "symmetric_log_r")])


@pytest.mark.parametrize("text", [MASKED, DAPO], ids=["masked", "dapo"])
def test_every_claim_at_a_degenerate_held_point_is_held_point_only(text):
    """On equal responses w is 0 (or nowhere finite) by the group; with the group's advantages
    spread, w = 0.375 for r > 3 (MASKED): every claim, admissibility included, says so."""
    res = analyze(dsl.parse(text, "d.dsl"), group=(1, 1, 1, 1), own_advantage=False)
    out = to_json(res)
    assert set(claim_statuses(out)) == {"held point only"}
    assert "no gradient" not in kinds(res) and kinds(res).count("degenerate held point") == 2
    text_out = report(res, width=None)
    assert "proven" not in text_out and "w(1) = 1            no: " in text_out
    assert all(w.startswith("held point only: ") or "at this held point only" in w for w in out["warnings"])
    assert all("held point only" in line for line in text_out.splitlines()
               if line.startswith(("    w(1) = 1", "    bounded  ", "    symmetric in log r", "    (tails")))


def test_the_moved_point_is_searched_past_the_objectives_thresholds():
    """The moved held point's w, found on the arbiter's grid (its thresholds included): 0.375 =
    1 − mean(1, 0, −0.5, 2) just past r = 3, where the mask opens."""
    out = to_json(analyze(dsl.parse(MASKED, "m.dsl"), group=(1, 1, 1, 1), own_advantage=False))
    said = out["claims"]["boundary"]["positive"]["evidence"]
    assert "w = 0.375 at r = 3.000003" in said and "(the group's advantages A·(1, 0, -0.5, 2))" in said


def test_a_zero_weight_on_equal_responses_that_no_moved_point_shows_is_unconfirmed_never_proven():
    """A mask on |A| past the arbiter's magnitudes: w is 0 on the grid at the moved point too,
    and on equal responses that settles nothing: every claim 'unconfirmed', no warning 'proven'."""
    res = analyze(dsl.parse("r*(A - group_mean(seq_mean(A)))*[abs(A) > 1e7]", "big.dsl"), group=(1, 1, 1, 1),
                  own_advantage=False)
    out = to_json(res)
    assert set(claim_statuses(out)) == {"unconfirmed"}
    assert "proven" not in report(res, width=None) and "(unconfirmed: evidence under" in report(res, width=None)
    assert out["warnings"] and all(w.startswith("unconfirmed: ") for w in out["warnings"])


def test_the_json_held_lines_carry_the_group_and_the_moved_point(tmp_path, capsys):
    path = tmp_path / "m.dsl"
    path.write_text(DAPO + "\n")      # (its filter beside the bare A: w is against the host's A)
    assert analyze_main(["--group", "1,1,1,1", "--json", str(path)]) == 0
    held = {h["name"]: h for h in json.loads(capsys.readouterr().out)["scope"]["held"]}
    assert held["G"]["group"] == [1.0, 1.0, 1.0, 1.0] and "(--group 1,1,1,1:" in held["G"]["text"]
    assert held["degenerate"]["moved"] == {"group": [1.0, 0.0, -0.5, 2.0], "held": {},
                                           "found": ["positive", "negative"]}
    spread = to_json(analyze(dsl.parse(GN, "gn.dsl"), group=(1, 0, 0), own_advantage=False))["scope"]["held"]
    assert [h["group"] for h in spread if h["name"] == "G"] == [[1.0, 0.0, 0.0]]


@pytest.mark.parametrize("text, point, said, group", [
    (MASKED, {"group": (1, 1, 1, 1)}, "(--group 1,1,1,1: every response's advantage is A)", [1.0] * 4),
    ("r*A - 0.1*group_mean(r)", {"group": (1, 0)}, "(G from --group 1,0: no group reduction here reads A)",
     [1.0, 0.0]),
    ("r*A - 0.1*group_mean(r)", {"group_size": 3}, "a group of G = 3 equal responses (--group-size)", None),
])
def test_the_held_groups_line_says_where_g_came_from(text, point, said, group):
    (held,) = [h for h in to_json(analyze(dsl.parse(text, "g.dsl"), own_advantage=False, **point))["scope"]["held"]
               if h["name"] == "G"]
    assert said in held["text"] and held.get("group") == group


def test_a_zero_weight_that_every_held_point_has_stays_proven():
    """A mask no ratio passes: w ≡ 0 at any held group, so that stays a proven property of ℓ."""
    res = analyze(dsl.parse("[r > 2]*[r < 1]*r*(seq_mean(A) - group_mean(seq_mean(A)))", "never.dsl"))
    assert kinds(res).count("no gradient") == 2 and "degenerate held point" not in kinds(res)
    assert res.claims["boundary"]["positive"]["status"] == "proven"


# a group reduction of A reads it position by position; the fix each warning names
BY_POSITION = [
    ("r*(A - group_mean(A))", ["group_mean(seq_mean(A))"]),
    ("r*A/(group_std(A) + 1)", ["group_std(seq_mean(A))"]),
    ("x = 2*A\nr*(A - group_mean(x))", ["group_mean(2 * seq_mean(A))"]),
    ("r*(A - group_mean(seq_mean(A)))", []),
    ("r*(A - group_mean(prefix_mean(A)))", ["group_mean(seq_mean(A))"]),     # A's running mean is A
    ("r*A/(group_std(prefix_mean(seq_mean(A))) + 1)", ["group_std(seq_mean(A))"]),
    ("r*(A - group_mean(prefix_sum(A)))", []),                     # p·A: positional by its prefix
    ("r*A*group_count(A)", []),                                   # a count reads no value
    ("r*(A - group_sum(A*prefix_sum(1))/group_sum(prefix_sum(1)))", []),   # token-level by its prefix too (OTB)
    ("r*group_mean(r*A)", []),
]


@pytest.mark.parametrize("text, fixes", BY_POSITION)
def test_a_group_reduction_of_a_is_warned_of_in_the_report_and_when_the_loss_is_built(text, fixes):
    obj = dsl.parse(text, "bp.dsl")
    said = [a for a in report(analyze(obj), width=None).splitlines() if "position by position" in a]
    assert [f for f in fixes if not any(f"write {f} to reduce each response once" in s for s in said)] == []
    assert len(said) == len(fixes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CompiledLoss(obj, fused=False)
    built = [str(w.message) for w in caught if "position by position" in str(w.message)]
    assert len(built) == len(fixes) and all(f in b for f, b in zip(fixes, built))


def test_what_the_position_by_position_warning_says_is_what_the_loss_does():
    """A winning response longer than the others: with group_mean(A) its later tokens get no
    gradient ([1.5, 0, 0]); with group_mean(seq_mean(A)), every token the same ([1.5, 1.5, 1.5])."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    A = torch.tensor([[2.0], [-0.25], [-0.25]], dtype=torch.float64).expand(3, 3)
    per_token = {}
    for text in ("r*(A - group_mean(A))", "r*(A - group_mean(seq_mean(A)))"):
        logp = torch.full((3, 3), -1.0, dtype=torch.float64, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss, _ = CompiledLoss(dsl.parse(text, "g.dsl"), fused=False)(logp, logp.detach(), A, mask,
                                                                             groups=torch.zeros(3, dtype=torch.long))
        (grad,) = torch.autograd.grad(loss, logp)
        per_token[text] = (-5 * grad[0]).tolist()
    assert per_token["r*(A - group_mean(A))"] == pytest.approx([1.5, 0.0, 0.0])
    assert per_token["r*(A - group_mean(seq_mean(A)))"] == pytest.approx([1.5, 1.5, 1.5])


KL_ENTROPY = "β = 0.04\nδ = 0.01\nr*A - β*(π_ref/π - log(π_ref/π) - 1) + δ*H"


@pytest.mark.parametrize("spec, w_range", [("grpo_k3", [0.0, 1.0]), (KL_ENTROPY, [1.0, 1.0])])
def test_the_reference_terms_are_their_own_channel_and_no_warning_about_w_reads_them(spec, w_range):
    obj = dsl.load(spec) if "\n" not in spec else dsl.parse(spec, "klh.dsl")
    res = analyze(obj)
    assert res.reference["own"] and res.weight_range == w_range
    assert {"unbounded", "entangled"} & set(kinds(res)) == set()
    out = to_json(res)
    assert out["text"]["reference"] == "β·(q − 1)" and out["reference"]["own_channel"]
    assert "  induced weight  w = (∂ℓ/∂r)/A of the terms that do not read π_ref" in report(res, width=None)


def test_channel_formulas_show_the_parameters_names():
    out = to_json(analyze(dsl.parse(KL_ENTROPY, "klh.dsl")))
    assert (out["text"]["w_H"], out["text"]["reference"]) == ("δ", "β·(q − 1)")


def test_a_zero_weight_with_the_group_moving_together_is_never_proven_for_a_token_of_a_spread_group(capsys, tmp_path):
    """r/group_mean(r)·A at --group 1,0,-0.5: with every response's r moving together w = 0, but a
    token's own gradient collects the other responses' terms, which differ by their advantages:
    autograd through the compiled loss on that group gives (1 − mean(c))/r = 5/(6r), not 0. The
    report's w = 0 and its 'no gradient' are unconfirmed there, never proven (issue 45)."""
    obj = dsl.parse("r/group_mean(r)*A", "gm.dsl")
    c = torch.tensor([1.0, 0.0, -0.5], dtype=torch.float64)
    old = torch.full((3, 1), -1.3, dtype=torch.float64)
    logp = (old + 0.2).requires_grad_()
    loss, _ = CompiledLoss(obj, fused=False)(logp, old, (0.7 * c)[:, None], torch.ones(3, 1, dtype=torch.bool),
                                             groups=torch.zeros(3, dtype=torch.long))
    (grad,) = torch.autograd.grad(loss, logp)
    assert float(-3 * grad[0, 0]) == pytest.approx(5 / 6 * 0.7, rel=1e-12)      # w·r·A with w = 5/(6r)
    res = analyze(obj, group=(1, 0, -0.5))
    assert set(claim_statuses(to_json(res))) == {"unconfirmed"}
    assert "proven" not in report(res, width=None)
    held = next(h["text"] for h in res.scope["held"] if h["name"] == "degenerate")
    assert "a token's own gradient also collects the other responses' terms" in held
    # on equal responses the token's own gradient is the derived one: w = 0 stays proven there
    assert res.claims["boundary"]["positive"]["status"] == "unconfirmed"
    assert analyze(obj, group=(1, 1, 1)).claims["boundary"]["positive"]["status"] == "proven"


def _symbols():
    import sympy as sp
    r, mu = sp.symbols("r mu", positive=True)
    return sp, (r, mu, sp.Symbol("A", real=True, nonzero=True))


# (the value, whether it is shown to move): each False is left to sp.simplify, as before the probe
MOVES = [
    ("r**2/(r**2 + 1/10**8)", True),           # FeynRL's ESS on the uniform batch: moves by 1e-8 only
    ("A*mu", True),
    ("Piecewise((r, r > 1), (1, True))", True),
    ("3", False),
    ("Piecewise((1, r >= 0), (1, True))", False),
    ("sin(r)**2 + cos(r)**2", False),          # constant, and sin is no node the probe knows
    ("1 + r/10**40", False),                   # moves, but below the probe's resolution: simplify decides
    ("log(A)", False),                          # complex at A < 0
    ("Piecewise((r, r > 5))", False),           # undefined at both points
    ("exp(1000*r)/exp(1000*r - 1)", False),     # e at every point, past the doubles on the way
]


@pytest.mark.parametrize("text, moves", MOVES)
def test_a_held_statistic_is_called_moving_only_where_it_takes_two_values(text, moves):
    from openrlhf_drpo.analysis.batch.held import _moves
    sp, point = _symbols()
    value = sp.sympify(text, locals=dict(zip(("r", "mu", "A"), point)))
    assert _moves(value, point) is moves


def test_the_probe_reads_a_settled_condition_sympy_cannot_rebuild():
    # the uniform view of OTB's baseline holds [group_count(A) >= 2] as Piecewise((1, 8 >= 2), ...): SymPy's
    # evalf raises rebuilding it; the probe takes the first piece whose condition holds
    from openrlhf_drpo.analysis.batch.held import _moves
    sp, (r, mu, A) = _symbols()
    kept = sp.Piecewise((1, sp.Ge(8, 2, evaluate=False)), (0, True), evaluate=False)
    assert _moves(sp.Mul(A * mu * r, kept, evaluate=False), (r, mu, A)) is True
    assert _moves(sp.Add(kept, sp.Mul(0, r, evaluate=False), evaluate=False), (r, mu, A)) is False
