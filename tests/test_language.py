"""The objective language: every shipped objective parses, spellings agree, every bad
input gets its exact located message, and no text makes the parser raise anything else."""
import re
import subprocess
import sys
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings, strategies as st

import dsl
from dsl import DslError, parse
from dsl.errors import DslWarning
from dsl.ir import Node
from dsl.names import GREEK
from dsl.operations import OPS
from dsl.printing import render

SHIPPED = dsl.shipped_names()
# the hint for an unknown function lists the operation table's callable rows in its order, so that
# an atom added there (docs/contributing.md) joins it without a list here to edit
CALLABLE = ", ".join(k for k, op in OPS.items() if op.callable)


def test_library_ships_every_objective_the_paper_compares():
    assert set(SHIPPED) >= {
        "surrogate", "ppo", "grpo_clip_higher", "ppo_dual_clip", "spo", "dppo_binary_tv",
        "dppo_binary_kl", "drpo", "kl", "k3", "tv", "kl_no_adv", "tv_no_adv", "mask_drpo",
        "mask_spo", "mask_kl", "cispo"}


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_objective_parses_and_names_its_source(name):
    obj = dsl.load(name)
    assert obj.name == name
    assert "source" in obj.description.lower(), "each shipped file names its method and source"
    assert any(m.op == "var" and m.value in ("r", "pi", "pi_v") for m in obj.expr.walk())     # it reads the policy


def _ascii_spelling(text: str) -> str:
    for ascii_name, uni in sorted(GREEK.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(uni, ascii_name)
    for uni, ascii_op in {"²": "^2", "³": "^3", "≤": "<=", "≥": ">=", "≠": "!=", "·": "*", "←": "<-",
                          "∈": "in", "−": "-"}.items():
        text = text.replace(uni, ascii_op)
    return text


@pytest.mark.parametrize("name", SHIPPED)
def test_unicode_and_ascii_spellings_of_each_shipped_objective_give_identical_ir(name):
    uni = dsl.load(name)
    ascii_text = _ascii_spelling(uni.source)
    assert all(ord(c) < 128 for line in ascii_text.splitlines() if not line.startswith("#") for c in line)
    asc = parse(ascii_text, "ascii.dsl")
    long_eps = parse(re.sub(r"\beps", "epsilon", ascii_text), "long.dsl")     # eps_low, not kl_loss_ctrl's steps
    assert uni.expr == asc.expr == long_eps.expr
    assert uni.params == asc.params == long_eps.params
    assert uni.controls == asc.controls == long_eps.controls


@pytest.mark.parametrize("text", [
    "δ = 12.5\nr*A - |A|/(2δ)*μ*(r-1)^2",
    "delta = 12.5\nr*A - abs(A)/(2*delta)*mu*(r-1)**2",
    "delta = 12.5\nr*A - |A|/(2 delta)*mu*(r - 1)^2".replace("2 delta", "2*delta"),
    "δ = 12.5\nr·A − |A|/(2δ)·µ·(r−1)²",             # middle dot, minus sign, micro sign, superscript
    "δ = 12.5\n(r*A) - ((|A|/(2*δ))*μ)*((r-1)^2)",
    "δ = 125e-1\nr*A - |A|/(2δ)*(π/r)*(r-1)^2".replace("(π/r)", "μ"),
    "# a comment\nδ = 12.5   # trailing comment\n\nr*A - |A|/(2δ)*μ*(r-1)^2\n",
])
def test_every_spelling_of_drpo_gives_the_same_ir(text):
    ref = dsl.load("drpo")
    got = parse(text)
    assert got.expr == ref.expr and got.params == ref.params


@pytest.mark.parametrize("text, expected", [
    ("-r^2*A", "-r^2 * A"),                      # power binds tighter than unary minus
    ("(-r)^2*A", "(-r)^2 * A"),
    ("r^2^3*A", "r^2^3 * A"),                    # right-associative
    ("r^-1*A", "r^(-1) * A"),
    ("x = 2\n2x^2*r", "2 * x^2 * r"),            # 2x² is 2·(x²)
    ("2(r-1)*A", "2 * (r - 1) * A"),
    ("2|A|*r", "2 * |A| * r"),
    ("|A - 2|*r", "|A - 2| * r"),
    (".5r*A + 1e-3*r", "0.5 * r * A + 0.001 * r"),
    ("r*A/(2*3)", "r * A / (2 * 3)"),
    ("r - (A - r)", "r - (A - r)"),
    ("[r > 1 and not A < 0 or r == 1]*r*A", "[r > 1 and not A < 0 or r == 1] * r * A"),
    ("[r ≥ 1 ∧ ¬(A ≠ 0)]*r", "[r ≥ 1 and not A ≠ 0] * r"),
    ("pi*A", "π * A"),                           # π is the policy's probability, not 3.14159
])
def test_precedence_and_canonical_form(text, expected):
    obj = parse(text)
    assert render(obj.expr) == expected
    assert parse(obj.canonical()).expr == obj.expr


def test_pi_is_a_symbol_not_a_constant():
    assert parse("pi*A").expr.args[0] == Node("var", value="pi")


def test_options_have_defaults_and_can_be_declared_and_overridden():
    assert dsl.load("drpo").options == {"anchor": "old", "aggregate": "token-mean"}
    obj = parse("@anchor = rollout\n@aggregate = seq-mean-token-sum-norm\nr*A")
    assert obj.options == {"anchor": "rollout", "aggregate": "seq-mean-token-sum-norm"}
    assert obj.with_overrides(options={"anchor": "old"}).options["anchor"] == "old"


@pytest.mark.parametrize("key", ["ε_high", "eps_high", "epsilon_high"])
def test_parameters_are_overridden_by_ascii_or_unicode_name(key):
    obj = dsl.load("grpo_clip_higher", params={key: "0.3"})
    assert obj.params == {"eps_low": Fraction(1, 5), "eps_high": Fraction(3, 10)}


@pytest.mark.parametrize("params, expected", [
    ({"foo": 1}, "--set:1:1: error: unknown parameter 'foo' for objective 'drpo'\n    foo=1\n    ^\n"
                 "hint: its parameters are: δ"),
    ({"delta": "inf"}, "--set:1:7: error: parameter value 'inf' is not a finite number\n    delta=inf\n"
                       "          ^\nhint: write a decimal number such as 0.2, .5 or 1e-3"),
    ({"delta": "abc"}, "--set:1:7: error: parameter value 'abc' is not a finite number\n    delta=abc\n"
                       "          ^\nhint: write a decimal number such as 0.2, .5 or 1e-3"),
])
def test_bad_overrides_are_located_errors(params, expected):
    with pytest.raises(DslError) as e:
        dsl.load("drpo").with_overrides(params, where="--set")
    assert e.value.render() == expected


ERRORS = [
    ('constant_not_finite', 'r*A + log(0)',
     "obj.dsl:1:7: error: 'log(0)' is not a finite number\n    r*A + log(0)\n          ^\n"
     "hint: a sub-expression of parameters and numbers only must be a finite number"),
    ('negative_parameter_to_a_fractional_power', 'd = -2\nr*A*d^0.5',
     "obj.dsl:2:5: error: 'd^0.5' is not a real number at d = -2: a negative base to a fractional power\n"
     "    r*A*d^0.5\n        ^\nhint: a sub-expression of parameters and numbers only must be a finite real number"),
    ('negative_number_to_a_fractional_power', 'r*A*(-2)^0.5',
     "obj.dsl:1:5: error: '(-2)^0.5' is not a real number: a negative base to a fractional power\n"
     "    r*A*(-2)^0.5\n        ^\nhint: a sub-expression of parameters and numbers only must be a finite real number"),
    ('negated_parameter_to_a_parameter_power', 'e = 0.5\nr*A*(-e)^e',
     "obj.dsl:2:5: error: '(-e)^e' is not a real number at e = 0.5: a negative base to a fractional power\n"
     "    r*A*(-e)^e\n        ^\nhint: a sub-expression of parameters and numbers only must be a finite real number"),
    ('log_of_a_negative_constant', 'r*A + log(-1)',
     "obj.dsl:1:7: error: 'log(-1)' is not a real number: log of a negative number\n"
     "    r*A + log(-1)\n          ^\nhint: a sub-expression of parameters and numbers only must be a finite real number"),
    ('sqrt_of_a_negative_parameter', 'd = -2\nr*A*sqrt(d)',
     "obj.dsl:2:5: error: 'sqrt(d)' is not a real number at d = -2: sqrt of a negative number\n"
     "    r*A*sqrt(d)\n        ^\nhint: a sub-expression of parameters and numbers only must be a finite real number"),
    ('non_real_constant_inside_a_condition', 'r*A*[(-2)^0.5 > 0] + r',
     "obj.dsl:1:6: error: '(-2)^0.5' is not a real number: a negative base to a fractional power\n"
     "    r*A*[(-2)^0.5 > 0] + r\n         ^\nhint: a sub-expression of parameters and numbers only must be a finite real number"),
    ('innermost_constant_is_named', 'd = 0\nr*A + exp(log(d))',
     "obj.dsl:2:11: error: 'log(d)' is not a finite number at d = 0\n"
     "    r*A + exp(log(d))\n              ^\nhint: a sub-expression of parameters and numbers only must be a finite number"),
    ('division_by_zero_parameter', 'δ = 0\nr*A - |A|/(2δ)*(r-1)^2',
     "obj.dsl:2:12: error: division by zero: '2 * δ' is 0 at δ = 0\n    r*A - |A|/(2δ)*(r-1)^2\n"
     "               ^\nhint: a sub-expression of parameters and numbers only must be a finite number"),
    ('number_too_large', 'r*A + 1e99999999',
     "obj.dsl:1:7: error: the number '1e99999999' is not finite in double precision\n    r*A + 1e99999999\n"
     "          ^\nhint: write a number below 1.8e308"),
    ('expression_too_long', 'r*A' + '+r' * 3000,
     "obj.dsl:1:1: error: the expression is too long or too deeply nested to handle\n    r*A" + "+r" * 3000 +
     "\n    ^\nhint: name sub-expressions with name = ... on their own lines"),
    ('syntax_unexpected_end', 'r*A +',
     "obj.dsl:1:6: error: unexpected end of line\n    r*A +\n         ^\nhint: expected '(', '+', '-', '[', '|', a name, a number"),
    ('syntax_unclosed_paren', '(r*A',
     "obj.dsl:1:5: error: unexpected end of line\n    (r*A\n        ^\nhint: the '(' at column 1 is never closed"),
    ('syntax_unclosed_bar', 'r*|A',
     "obj.dsl:1:5: error: unexpected end of line\n    r*|A\n        ^\nhint: the '|' at column 3 is never closed"),
    ('syntax_bad_character', 'r$A',
     "obj.dsl:1:2: error: unexpected character '$'\n    r$A\n     ^\nhint: operators are + - * / ^, comparisons < <= > >= == !=, and/or/not"),
    ('en_dash_for_minus', 'r*A – 0.1*H',
     "obj.dsl:1:5: error: unexpected character '–' (an en dash)\n    r*A – 0.1*H\n        ^\nhint: write '-' (the ASCII hyphen-minus) for minus"),
    ('decimal_comma', 'r*A - 12,25*H',
     "obj.dsl:1:9: error: unexpected ',' in a number\n    r*A - 12,25*H\n            ^\nhint: a decimal comma: write 12.25, with a decimal point"),
    ('trailing_semicolon', 'r*A;  # the surrogate',
     "obj.dsl:1:4: error: unexpected ';'\n    r*A;  # the surrogate\n       ^\nhint: a statement ends at the end of its line: delete the ';'"),
    ('semicolon_between_statements', 'δ = 1; r*A',
     "obj.dsl:1:6: error: unexpected ';'\n    δ = 1; r*A\n         ^\nhint: write each statement on its own line"),
    ('entropy_is_named_H', 'r*A + 0.01*entropy',
     "obj.dsl:1:12: error: unknown name 'entropy'\n    r*A + 0.01*entropy\n               ^\nhint: the built-in H is the policy's "
     "entropy at the token, in nats over the vocabulary (with its gradient); or declare 'entropy' as a parameter on its own "
     "line, e.g. 'entropy = 0.1'"),
    ('ratio_is_named_r', 'ratio*A',
     "obj.dsl:1:1: error: unknown name 'ratio'\n    ratio*A\n    ^\nhint: the built-in r is the importance ratio π/μ; or "
     "declare 'ratio' as a parameter on its own line, e.g. 'ratio = 0.1'"),
    ('unknown_name', 'r*A - foo*(r-1)^2',
     "obj.dsl:1:7: error: unknown name 'foo'\n    r*A - foo*(r-1)^2\n          ^\nhint: declare it as a parameter on its own line, e.g. 'foo = 0.1'"),
    ('unknown_name_suggests', 'delta = 1\nr*A - delt*(r-1)^2',
     "obj.dsl:2:7: error: unknown name 'delt'\n    r*A - delt*(r-1)^2\n          ^\nhint: declare it as a parameter on its own line, e.g. 'delt = 0.1'; did you mean 'δ'?"),
    ('unknown_function', 'r*A*lg(r)',
     "obj.dsl:1:5: error: unknown function 'lg'\n    r*A*lg(r)\n        ^\nhint: functions are: " + CALLABLE + "; did you mean 'log'?"),
    ('unknown_function_suggests', 'r*A*clamp(r, 0, 1)',
     "obj.dsl:1:5: error: unknown function 'clamp'\n    r*A*clamp(r, 0, 1)\n        ^\nhint: functions are: " + CALLABLE + "; did you mean 'clip'?"),
    ('name_is_not_a_function', 'δ = 1\nr*A*δ(r-1)',
     "obj.dsl:2:5: error: 'δ' is not a function\n    r*A*δ(r-1)\n        ^\nhint: to multiply, write δ*(...)"),
    ('wrong_arity_clip', 'clip(r, 0.8)*A',
     'obj.dsl:1:1: error: clip() takes 3 arguments, got 2\n    clip(r, 0.8)*A\n    ^\nhint: write clip(x, lo, hi)'),
    ('wrong_arity_log', 'log(r, 2)*A',
     'obj.dsl:1:1: error: log() takes 1 argument, got 2\n    log(r, 2)*A\n    ^\nhint: write log(x)'),
    ('wrong_arity_erf', 'erf(r, 2)*A',
     'obj.dsl:1:1: error: erf() takes 1 argument, got 2\n    erf(r, 2)*A\n    ^\nhint: write erf(x)'),
    ('unknown_arctan', 'A*arctan(r)',
     "obj.dsl:1:3: error: unknown function 'arctan'\n    A*arctan(r)\n      ^\nhint: functions are: " + CALLABLE + "; did you mean 'atan'?"),
    ('internal_op_is_not_a_function', 'derf(r)*A',
     "obj.dsl:1:1: error: unknown function 'derf'\n    derf(r)*A\n    ^\nhint: functions are: " + CALLABLE + "; did you mean 'erf'?"),
    ('wrong_arity_min', 'min(r)*A',
     'obj.dsl:1:1: error: min() takes at least 2 arguments, got 1\n    min(r)*A\n    ^\nhint: write min(a, b, ...)'),
    ('function_used_as_name', 'r*A*log',
     "obj.dsl:1:5: error: 'log' is a function; call it as log(...)\n    r*A*log\n        ^"),
    ('rebind_builtin', 'r = 2\nr*A',
     "obj.dsl:1:1: error: 'r' is a built-in (the importance ratio π/μ) and cannot be rebound\n    r = 2\n    ^\nhint: choose another name"),
    ('rebind_builtin_unicode', 'π = 0.5\nr*A',
     "obj.dsl:1:1: error: 'π' is a built-in (the current probability of the sampled token) and cannot be rebound\n    π = 0.5\n    ^\nhint: choose another name"),
    ('duplicate_name', 'δ = 1\ndelta = 2\nr*A',
     "obj.dsl:2:1: error: 'delta' is already defined on line 1\n    delta = 2\n    ^\nhint: each name is defined once; Unicode and ASCII spellings (δ, delta) are the same name"),
    ('duplicate_binding', 'D = r\nD = r*2\nD*A',
     "obj.dsl:2:1: error: 'D' is already defined on line 1\n    D = r*2\n    ^\nhint: each name is defined once; Unicode and ASCII spellings (δ, delta) are the same name"),
    ('no_objective', 'δ = 1',
     'obj.dsl:1:1: error: no objective: every line is a definition\n    δ = 1\n    ^\nhint: add one line that is a bare expression, e.g. r*A'),
    ('two_objectives', 'r*A\nr*A*2',
     'obj.dsl:2:1: error: a second objective line (the first is on line 1)\n    r*A*2\n    ^\nhint: exactly one line is the objective; name sub-expressions with name = ...'),
    ('empty_file', '',
     'obj.dsl:1:1: error: the objective file is empty\n    \n    ^\nhint: write the objective as an expression, e.g. r*A'),
    ('only_comments', '# nothing here\n\n',
     'obj.dsl:1:1: error: the objective file is empty\n    # nothing here\n    ^\nhint: write the objective as an expression, e.g. r*A'),
    ('parameter_not_finite', 'δ = 1e999\nr*A',
     "obj.dsl:1:5: error: parameter value '1e999' is not a finite number\n    δ = 1e999\n        ^\nhint: write a decimal number such as 0.2, .5 or 1e-3"),
    ('no_policy_dependence', 'A*2',
     'obj.dsl:1:1: error: the objective does not depend on the policy\n    A*2\n    ^\nhint: use r, π or H outside sg(...), [...] and sign(...); otherwise its gradient is zero'),
    ('policy_only_in_sg', 'sg(r)*A',
     'obj.dsl:1:1: error: the objective does not depend on the policy\n    sg(r)*A\n    ^\nhint: use r, π or H outside sg(...), [...] and sign(...); otherwise its gradient is zero'),
    ('policy_only_in_indicator', '[r > 1]*A',
     'obj.dsl:1:1: error: the objective does not depend on the policy\n    [r > 1]*A\n    ^\nhint: use r, π or H outside sg(...), [...] and sign(...); otherwise its gradient is zero'),
    ('implicit_between_names', 'r A',
     "obj.dsl:1:3: error: ambiguous implicit multiplication\n    r A\n      ^\nhint: implicit multiplication is allowed only right after a number (2δ, 2(r-1), 2|x|) and never in a divisor; write '*' explicitly, e.g. a/(b*c) or a/b*c, |a|*|b|"),
    ('implicit_in_divisor', 'δ = 1\nr*A/2δ',
     "obj.dsl:2:6: error: ambiguous implicit multiplication\n    r*A/2δ\n         ^\nhint: implicit multiplication is allowed only right after a number (2δ, 2(r-1), 2|x|) and never in a divisor; write '*' explicitly, e.g. a/(b*c) or a/b*c, |a|*|b|"),
    ('implicit_after_division', 'a = 1\nb = 2\nr*A/b a',
     "obj.dsl:3:7: error: ambiguous implicit multiplication\n    r*A/b a\n          ^\nhint: implicit multiplication is allowed only right after a number (2δ, 2(r-1), 2|x|) and never in a divisor; write '*' explicitly, e.g. a/(b*c) or a/b*c, |a|*|b|"),
    ('implicit_between_bars', '|A||r|',
     "obj.dsl:1:4: error: ambiguous implicit multiplication\n    |A||r|\n       ^\nhint: implicit multiplication is allowed only right after a number (2δ, 2(r-1), 2|x|) and never in a divisor; write '*' explicitly, e.g. a/(b*c) or a/b*c, |a|*|b|"),
    ('implicit_with_space', 'δ = 1\nr*A*2 δ',
     'obj.dsl:2:7: error: implicit multiplication needs the number directly before its factor\n    r*A*2 δ\n          ^\nhint: write 2*... or remove the space'),
    ('condition_as_number', 'r*A + (r > 1)',
     "obj.dsl:1:8: error: the condition 'r > 1' is used as a number\n    r*A + (r > 1)\n           ^\nhint: write [r > 1] for its 0/1 indicator"),
    ('number_as_condition', '[r]*A*r',
     "obj.dsl:1:2: error: expected a condition, found the number 'r'\n    [r]*A*r\n     ^\nhint: conditions use < <= > >= == != and, or, not; e.g. [r > 1]"),
    ('unknown_option', '@anchr = old\nr*A',
     "obj.dsl:1:1: error: unknown option '@anchr'\n    @anchr = old\n    ^\nhint: options are: @anchor, @aggregate; did you mean '@anchor'?"),
    ('bad_option_value', '@aggregate = token-sum\nr*A',
     "obj.dsl:1:14: error: 'token-sum' is not a value of @aggregate\n    @aggregate = token-sum\n                 ^\nhint: @aggregate is one of: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm"),
    ('duplicate_option', '@anchor = old\n@anchor = rollout\nr*A',
     "obj.dsl:2:1: error: option '@anchor' is set twice\n    @anchor = rollout\n    ^"),
    ('option_as_name', 'anchor = 1\nr*A',
     "obj.dsl:1:1: error: 'anchor' names an option; set it with @anchor = ...\n    anchor = 1\n    ^"),
    ('self_reference', 'D = D*r\nD*A',
     "obj.dsl:1:5: error: 'D' is defined in terms of itself\n    D = D*r\n        ^"),
]


@pytest.mark.parametrize("name, source, expected", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_gets_its_exact_located_message(name, source, expected):
    with pytest.raises(DslError) as e:
        parse(source, "obj.dsl")
    assert e.value.render() == expected
    assert (e.value.path, e.value.line, e.value.col) == ("obj.dsl",) + tuple(
        int(x) for x in expected.split(":")[1:3])


@pytest.mark.parametrize("entry", ["drpo-analyze", "CompiledLoss", "drpo-train"])
def test_a_constant_that_is_not_real_is_a_located_error_at_every_entry_point(tmp_path, entry):
    bad = tmp_path / "bad.dsl"
    bad.write_text("d = 0.5\nr*A*d^0.5\n")
    # the parameter overridden to a negative value: the check runs after overrides too
    script = {"drpo-analyze": ["-m", "openrlhf_drpo.cli", str(bad), "--set", "d=-2"],
              "drpo-train": ["-m", "openrlhf_drpo.hosts.openrlhf.train", "--drpo.objective", str(bad), "--drpo.set", "d=-2",
                             "--actor.model_name_or_path", "x"],
              "CompiledLoss": ["-c", "import sys\nfrom dsl import DslError\nfrom openrlhf_drpo.core import CompiledLoss\n"
                               f"try:\n    CompiledLoss({str(bad)!r}, d=-2)\nexcept DslError as e:\n"
                               "    print(e, file=sys.stderr)\n    sys.exit(1)"]}[entry]
    proc = subprocess.run([sys.executable, *script], capture_output=True, text=True, timeout=300)
    where = "--set" if entry != "CompiledLoss" else "CompiledLoss"
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"{bad}:2:5: error: 'd^0.5' is not a real number at d = -2: a negative base "
                                  "to a fractional power\n    r*A*d^0.5\n        ^\n"), (where, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr


def test_non_utf8_bytes_are_a_located_error():
    with pytest.raises(DslError) as e:
        dsl.parse_bytes("δ = 1\nr*A ".encode() + b"\xff", "bad.dsl")
    assert e.value.render() == ("bad.dsl:2:5: error: the file is not UTF-8: byte 0xff cannot be decoded\n"
                                "hint: save the objective file as UTF-8")


def test_overriding_a_parameter_into_a_division_by_zero_is_a_located_error():
    with pytest.raises(DslError) as e:
        dsl.load("drpo", params={"delta": "0"})
    assert e.value.render().startswith("objectives/drpo.dsl:4:12: error: division by zero: '2 * δ' is 0 at δ = 0")


def test_a_byte_order_mark_is_not_part_of_the_text():
    assert dsl.parse_bytes("\ufeffδ = 1\nr*A - |A|/(2δ)*(r-1)^2".encode(), "bom.dsl").params == {"delta": 1}


def test_unknown_objective_name_lists_the_library():
    with pytest.raises(DslError) as e:
        dsl.load("drp")
    assert e.value.render().startswith("drp:1:1: error: no objective file or shipped objective named 'drp'")
    assert "did you mean 'drpo'?" in e.value.render()


# ---------------------------------------------------------------- fuzzing
ALPHABET = st.sampled_from(list("rAμπδεx()[]|+-*/^²,.=<>!#@ \n0123456789_") +
                           ["and", "or", "not", "log", "min", "clip", "sg", "pi", "mu", "\xff", "é", "≤", "\r"])


@settings(max_examples=400, deadline=None)
@given(st.lists(ALPHABET, max_size=40).map("".join))
def test_arbitrary_text_raises_only_the_languages_own_error(text):
    try:
        obj = parse(text, "fuzz.dsl")
    except DslError as e:
        assert e.render().startswith("fuzz.dsl:")
    else:
        assert parse(obj.canonical(), "again.dsl").expr == obj.expr


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=60))
def test_arbitrary_bytes_raise_only_the_languages_own_error(data):
    try:
        dsl.parse_bytes(data, "bytes.dsl")
    except DslError as e:
        assert e.render().startswith("bytes.dsl:")


LEAVES = st.sampled_from(["r", "π", "μ", "A", "delta", "2", "0.5", "1e-3"])


def _exprs():
    return st.recursive(LEAVES, lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["+", "-", "*", "/", "^"]), inner).map(lambda t: f"({t[0]}){t[1]}({t[2]})"),
        inner.map(lambda x: f"-({x})"),
        inner.map(lambda x: f"|{x}|"),
        st.tuples(st.sampled_from(["log", "exp", "sqrt", "sign", "sg"]), inner).map(lambda t: f"{t[0]}({t[1]})"),
        st.tuples(st.sampled_from(["min", "max"]), inner, inner).map(lambda t: f"{t[0]}({t[1]}, {t[2]})"),
        st.tuples(inner, inner, inner).map(lambda t: f"clip({t[0]}, {t[1]}, {t[2]})"),
        st.tuples(inner, st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), inner).map(lambda t: f"[{t[0]} {t[1]} {t[2]}]"),
    ), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(_exprs())
def test_canonical_form_parses_back_to_the_same_ir(text):
    try:
        obj = parse(f"delta = 0.2\n{text}")
    except DslError as e:     # the language's own refusals of a random text: a constant that is not a
        # finite real number (1/[δ < δ], log(−δ)), or no policy to train
        assert re.search(r"does not depend on the policy|division by zero|is not a (finite|real) number", e.message), e
        assume(False)
    assert parse(obj.canonical()).expr == obj.expr


# ---------------------------------------------------------------- command line and install
def test_drpo_analyze_reports_errors_without_traceback_and_exits_nonzero(tmp_path):
    bad = tmp_path / "bad.dsl"
    bad.write_text("δ = 1\nr*A - |A|/(2δ)*(r-1)^2*foo\n")
    proc = subprocess.run([sys.executable, "-m", "openrlhf_drpo.cli", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"{bad}:2:24: error: unknown name 'foo'")
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "openrlhf_drpo.cli", str(bad), "--traceback"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_shipped_objectives_are_found_from_a_regular_install_and_no_local_folder_shadows_them(tmp_path):
    import pathlib
    import shutil
    root = pathlib.Path(__file__).resolve().parents[1]
    # built from a copy: pip writes build/ beside the sources, and the checkout stays untouched
    src = tmp_path / "src"
    # (never the virtual environments and wheels setup.sh leaves in the checkout: gigabytes)
    shutil.copytree(root, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__",
                                                             ".hypothesis", ".pytest_cache", "runs", ".venv*", ".whl",
                                                             ".gpuwhl"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, capture_output=True)
    # a user's own objectives/ folder in the working directory (first on sys.path)
    work = tmp_path / "work"
    (work / "objectives").mkdir(parents=True)
    (work / "objectives" / "drpo.dsl").write_text("r*A*2\n")
    (work / "objectives" / "mine.dsl").write_text("r*A*3\n")
    code = ("import dsl, dsl.library\n"
            "print(dsl.load('drpo').params, dsl.library.folder())\n"
            "try:\n    dsl.load('mine')\nexcept dsl.DslError as e:\n    print(e.message)\n")
    for env in ({"PYTHONPATH": str(target), "PATH": ""}, None):     # the regular install, then this checkout's
        out = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, env=env,
                             check=True).stdout
        assert "{'delta': Fraction(25, 2)}" in out, out
        assert "no objective file or shipped objective named 'mine'" in out
        assert str(work) not in out and (env is None or str(target) in out)


@pytest.mark.parametrize("default, value", [("1/5", Fraction(1, 5)), ("2^-3", Fraction(1, 8)), ("-(1/4)", Fraction(-1, 4)),
                                            ("1/3", Fraction(1, 3)), ("sqrt(4)/10", Fraction(1, 5)), ("sqrt(2)", Fraction("1.4142135623730951"))])
def test_a_parameter_default_may_be_a_constant_expression_and_stays_overridable(default, value):
    obj = parse(f"ε = {default}\nr*A - |A|/(2ε)*(r-1)^2")
    assert obj.params == {"eps": value}
    assert obj.with_overrides({"ε": "0.3"}).params == {"eps": Fraction(3, 10)}
    assert parse(obj.canonical()).params == obj.params      # the canonical form keeps it a parameter


@pytest.mark.parametrize("default", ["1/0", "log(0)", "exp(1000)"])
def test_a_constant_default_that_is_not_finite_is_a_located_error(default):
    with pytest.raises(DslError, match=r"<string>:1:5: error: parameter value '.*' is not a finite number"):
        parse(f"c = {default}\nr*A*c")


@pytest.mark.parametrize("value", [Fraction(10) ** 300, Fraction(1, 10 ** 400), Fraction(-3, 10 ** 50),
                                   Fraction(123456789012345678), Fraction(7, 10 ** 17)])
def test_numbers_render_short_and_parse_back_exactly(value):
    text = render(Node("num", value=value))
    assert len(text) < 25 and parse(f"p = {text}\nr*A*p").params["p"] == value


@pytest.mark.parametrize("source, canonical", [
    ("r*A - ｜A｜/25*(r-1)^2", "r * A - |A| / 25 * (r - 1)^2"),       # full-width bars are bars (NFKC)
    ("r*A - |A|*(r-1)⁴", "r * A - |A| * (r - 1)^4"),
    ("r*A - |A|*(r-1)¹⁰", "r * A - |A| * (r - 1)^10"),
    ("r*A*r⁻¹", "r * A * r^-1"),                                         # never r*A*r − 1
    ("r*A*(r+1)⁻²", "r * A * (r + 1)^-2"),
    ("r*A - 2|A|²", "r * A - 2 * |A|^2"),
    ("δ = 0.2\rr*A - |A|/(2δ)*(r-1)^2\r", "r * A - |A| / (2 * δ) * (r - 1)^2"),   # CR-only line endings
])
def test_unicode_spellings_parse_as_they_read(source, canonical):
    assert parse(source).canonical().splitlines()[-1] == canonical


@pytest.mark.parametrize("source, rendered", [
    ("а = 0.1\nr*A*a\n",
     "<string>:2:5: error: unknown name 'a'\n    r*A*a\n        ^\nhint: declare it as a parameter on its own line, "
     "e.g. 'a = 0.1'; 'a' and the defined 'а' look alike but are different names: 'а' is U+0430 CYRILLIC SMALL "
     "LETTER A, not Latin 'a'"),
    ("r*A*cοef\ncoef = 0.2\n",
     "<string>:1:5: error: unknown name 'cοef'\n    r*A*cοef\n        ^\nhint: declare it as a parameter on its own "
     "line, e.g. 'cοef = 0.1'; 'cοef' and the defined 'coef' look alike but are different names: 'ο' is U+03BF "
     "GREEK SMALL LETTER OMICRON, not Latin 'o'"),
    ("r*A\u200b + foo\n",
     "<string>:1:4: error: unexpected invisible character U+200B ZERO WIDTH SPACE\n    r*A\ufffd + foo\n       ^\n"
     "hint: delete it (it often comes with text copied from a web page or a word processor)"),
    ("r*A + \ufefffoo\n",
     "<string>:1:7: error: unexpected invisible character U+FEFF ZERO WIDTH NO-BREAK SPACE\n    r*A + \ufffdfoo\n"
     "          ^\nhint: delete it (it often comes with text copied from a web page or a word processor)"),
    ("\tr*A +\tfoo\n",
     "<string>:1:8: error: unknown name 'foo'\n    \tr*A +\tfoo\n    \t     \t^\n"
     "hint: declare it as a parameter on its own line, e.g. 'foo = 0.1'"),
    ("δ = 0.2\rr*A + foo\r",
     "<string>:2:7: error: unknown name 'foo'\n    r*A + foo\n          ^\n"
     "hint: declare it as a parameter on its own line, e.g. 'foo = 0.1'"),
    ("r*A*r⁻\n",
     "<string>:1:6: error: unexpected character '⁻'\n    r*A*r⁻\n         ^\n"
     "hint: a superscript exponent is digits with an optional sign before them, e.g. x⁻¹ or x²"),
])
def test_messages_show_what_is_really_there(source, rendered):
    with pytest.raises(DslError) as e:
        parse(source)
    assert e.value.render() == rendered


def _chain(depth, op):
    """b0 = r*A, b1 = b0 op b0, ...: written out as a tree, 2^depth copies of r*A."""
    return "\n".join(["b0 = r*A"] + [f"b{i} = b{i - 1} {op} b{i - 1}" for i in range(1, depth + 1)]
                     + [f"b{depth}"]) + "\n"


def test_chained_bindings_stay_shared_from_parsing_to_generated_code():
    # 60 levels: a tree walk anywhere (hashing, checks, printing, differentiating, codegen)
    # would visit 2^60 nodes and never finish; the subprocess's timeout turns that into a failure
    code = f"""
import torch
import dsl
from dsl.ir import postorder, tree_size
from openrlhf_drpo import ObjectiveLoss
obj = dsl.parse({_chain(60, '+')!r}, "chain.dsl")
assert len(postorder(obj.expr)) == 63 and tree_size(obj.expr) == 2**62 - 1
assert obj.canonical().splitlines()[-2:] == ["b60 = b59 + b59", "b60"]
assert dsl.parse(obj.canonical(), "again.dsl").expr == obj.expr
lp, old = torch.full((2, 3), -0.5, dtype=torch.float64), torch.full((2, 3), -0.7, dtype=torch.float64)
A, mask = torch.tensor([[1.0, -2.0, 0.5], [0.25, 1.0, -1.0]], dtype=torch.float64), torch.ones(2, 3)
grads = []
for fused in (True, False):
    x = lp.clone().requires_grad_()
    ObjectiveLoss(obj, fused=fused)(x, old, A, action_mask=mask)[0].backward()
    grads.append(x.grad)
# ℓ = 2^60·r·A, so ∂loss/∂log π = -2^60·r·A/6 per token
assert torch.allclose(grads[0], grads[1]) and torch.allclose(grads[0], -(2.0**60) * torch.exp(lp - old) * A / 6)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_a_long_expression_prints_abbreviated_without_a_name_to_refer_to():
    obj = parse(_chain(20, "*"), "chain.dsl")
    assert render(obj.expr) == "(an expression of 4,194,303 operations written out)"
    assert render(obj.bindings["b2"]) == "r * A * (r * A) * (r * A * (r * A))"     # short: written out


@pytest.mark.parametrize("op, expected", [("min", 0.5), ("max", 250 * 0.5)])
def test_numpy_plan_evaluates_a_min_or_max_of_250_arguments_as_the_ir_does(op, expected):
    # the compiled plan folds them in one reduce: nested calls past 200 levels do not compile
    import numpy as np
    from dsl.walks import evaluate, numpy_plan
    from dsl.parser import parse
    obj = parse(f"{op}(" + ", ".join(f"r*{i + 1}" for i in range(250)) + ")*A\n")
    env = {"r": 0.5, "mu": 0.5, "pi": 0.25, "A": 1.0}
    got = numpy_plan(obj.expr)({k: np.array([v]) for k, v in env.items()})[0]
    assert got[0] == evaluate(obj.expr, env) == expected


def test_a_definition_the_objective_never_reads_is_a_located_warning(tmp_path):
    (tmp_path / "u.dsl").write_text("# mine\nβ = 0.1\nk = r - 1\nδ = 0.2\nr*A - δ*(r-1)^2\n")
    with pytest.warns(DslWarning) as caught:
        dsl.load(str(tmp_path / "u.dsl"))
    assert [str(w.message).splitlines()[0] for w in caught] == [
        f"{tmp_path}/u.dsl:2:1: warning: parameter 'β' is never used by the objective",
        f"{tmp_path}/u.dsl:3:1: warning: definition 'k' is never used by the objective"]
    proc = subprocess.run([sys.executable, "-m", "openrlhf_drpo.cli", "u.dsl"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert proc.returncode == 0 and proc.stderr == (
        "u.dsl:2:1: warning: parameter 'β' is never used by the objective\n    β = 0.1\n    ^\n"
        "hint: a typo where it is used? otherwise delete the line\n"
        "u.dsl:3:1: warning: definition 'k' is never used by the objective\n    k = r - 1\n    ^\n"
        "hint: a typo where it is used? otherwise delete the line\n"), proc.stderr


def test_a_directory_given_as_an_objective_file_says_so(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.dsl").write_text("r*A\n")
    with pytest.raises(DslError) as e:
        dsl.load(str(tmp_path / "mine"))
    assert e.value.render() == (f"{tmp_path}/mine:1:1: error: '{tmp_path}/mine' is a directory, not an objective file\n"
                                "hint: name a .dsl file in it (a.dsl)")
