"""The language's third version (issue 29): the built-ins π_ref, H and Σ_v π_v², the prefix, group
and batch reductions, each value's level and an objective's locality, all decided on the IR; its
misuse as located errors; and the analysis's stated point for what it does not analyse yet."""
import pytest

import dsl
from dsl import DslError
from dsl.expressions import NOT_IN_LANGUAGE
from dsl.levels import kept_whole, levels, locality, reductions
from dsl.operations import OPS
from dsl.walks import uniform_view
from dsl.printing import render


@pytest.mark.parametrize("unicode, ascii_", [
    ("exp(log(π_ref) - log(π))*A", "exp(log(pi_ref) - log(pi))*A"),
    ("r*A - sum_π_sq", "r*A - sum_pi_sq"),
    ("r*A + 0.01*H", "r*A + 0.01*H"),
])
def test_the_new_built_ins_have_one_ir_in_unicode_and_ascii(unicode, ascii_):
    assert dsl.parse(unicode).expr == dsl.parse(ascii_).expr


def test_the_entropy_alone_is_an_objective_with_a_gradient():
    assert dsl.parse("0.01*H").names() == {"H"}


def test_a_name_for_a_reduction_of_numbers_is_a_binding_not_a_parameter():
    obj = dsl.parse("p = 0.5\nt = prefix_sum(1)\nexp(clip(log(r), -0.1*t^p, 0.1*t^p))*A")
    assert obj.params == {"p": 0.5} and "t" in obj.bindings and obj.bindings["t"].op == "prefix_sum"


ERRORS = [
    # a name of an earlier file that is now a built-in
    ("H = 0.1\nr*A - H*(r - 1)^2", 1, 1,
     "'H' is a built-in (the policy's entropy at the token, in nats over the vocabulary (with its gradient)) and "
     "cannot be rebound", "choose another name"),
    ("pi_ref = 0.5\nr*A", 1, 1, "'pi_ref' is a built-in (the reference model's probability of the sampled token)",
     "choose another name"),
    ("sum_π_sq = 1\nr*A", 1, 1, "'sum_π_sq' is a built-in (Σ_v π_v², the policy's collision probability",
     "choose another name"),
    # the policy only through inputs without a gradient
    ("sum_pi_sq*A", 1, 1, "the objective does not depend on the policy",
     "use r, π or H outside sg(...), [...] and sign(...); otherwise its gradient is zero; sum_π_sq is an input "
     "without a gradient"),
    ("exp(log(π_ref) - log(μ))*A + sum_pi_sq", 1, 1, "the objective does not depend on the policy",
     "π_ref and sum_π_sq are inputs without a gradient"),
    ("sg(H)*A", 1, 1, "the objective does not depend on the policy", "use r, π or H outside sg(...)"),
    # other frameworks' names for reductions: the language's spelling
    ("r*A - mean(r)", 1, 7, "'mean' is not a function of the language",
     "say which tokens it reduces: seq_mean(x) (its response), group_mean(x) (its prompt's responses) or "
     "batch_mean(x) (the optimizer batch)"),
    ("sum(log(r))*A", 1, 1, "'sum' is not a function of the language", "seq_sum(x) (its response), group_sum(x)"),
    ("r*A/std(A)", 1, 5, "'std' is not a function of the language", "write group_std(x), the sample standard"),
    ("exp(cumsum(log(r)))*A", 1, 5, "'cumsum' is not a function of the language", "write prefix_sum(x)"),
    ("cumprod(r)*A", 1, 1, "'cumprod' is not a function of the language", "write exp(prefix_sum(log(x)))"),
    ("r*A/batch_std(r)", 1, 5, "'batch_std' is not a function of the language",
     "write sqrt(batch_mean(x^2) - batch_mean(x)^2)"),
    ("quantile(r, 0.5)*A", 1, 1, "'quantile' is not a function of the language", "write batch_quantile(x, q)"),
    ("count(r)*A", 1, 1, "'count' is not a function of the language", "write seq_len, group_count(x) or batch_count(x)"),
    # the new functions' own misuse
    ("prefix_sum(r, 2)*A", 1, 1, "prefix_sum() takes 1 argument, got 2", "write prefix_sum(x)"),
    ("group_std()*r*A", 1, 1, "group_std() takes 1 argument, got 0", "write group_std(x)"),
    ("group_mean(r > 1)*A", 1, 12, "the condition 'r > 1' is used as a number", "write [r > 1] for its 0/1 indicator"),
    ("batch_mean*r*A", 1, 1, "'batch_mean' is a function; call it as batch_mean(...)", None),
    ("prefix_max(r)*A", 1, 1, "unknown function 'prefix_max'", "did you mean 'prefix_mean'?"),
]


@pytest.mark.parametrize("text, line, col, message, hint", ERRORS, ids=[e[3][:40] for e in ERRORS])
def test_misuse_of_the_third_version_is_a_located_error(text, line, col, message, hint):
    with pytest.raises(DslError) as e:
        dsl.parse(text, "x.dsl")
    assert (e.value.line, e.value.col) == (line, col)
    assert str(e.value).startswith(f"x.dsl:{line}:{col}: error: {message}")
    assert hint is None or hint in e.value.hint


@pytest.mark.parametrize("name", sorted(set(NOT_IN_LANGUAGE) - set(OPS)))
def test_a_reduction_name_the_language_lacks_is_refused_with_its_hint_until_a_row_defines_it(name):
    """Read from the tables, not pinned: a row added to OPS (the contributing page's group_max) takes
    its name out of the refused ones."""
    with pytest.raises(DslError) as e:
        dsl.parse(f"r*A*{name}(r)", "x.dsl")
    assert str(e.value).startswith(f"x.dsl:1:5: error: '{name}' is not a function of the language")
    assert e.value.hint == NOT_IN_LANGUAGE[name]


# ---------------------------------------------------------------- levels and locality
LEVELS = [
    ("2*δ", "constant"), ("A", "token"), ("H", "token"), ("seq_len", "response"), ("seq_mean(A)", "response"),
    ("prefix_sum(1)", "token"), ("group_mean(seq_mean(A))", "response"), ("group_mean(A)", "token"),
    ("group_count(1)", "response"), ("group_std(seq_len)", "response"), ("batch_mean(A)", "batch"),
    ("batch_sum(seq_mean(r))", "batch"), ("r*batch_mean(A)", "token"), ("seq_len*batch_mean(A)", "response"),
    ("group_mean(batch_mean(r))", "response"),
]


@pytest.mark.parametrize("text, level", LEVELS)
def test_each_value_has_the_level_its_operations_give(text, level):
    expr = dsl.parse(f"δ = 1\nr*A + sg({text})").expr
    inner = next(n for n in expr.walk() if n.op == "sg").args[0]
    assert levels(expr)[inner] == level, render(inner)


LOCALITY = [
    ("min(r*A, clip(r, 0.8, 1.2)*A)", "token", ()),
    ("exp(seq_mean(log(r)))*A", "response", ()),
    ("exp(prefix_sum(log(r)))*A", "response", ()),
    ("r*(A - group_mean(A))", "token", ("groups",)),             # a statistic of fixed inputs
    ("r*A*group_count(r)", "token", ("groups",)),                # a count reads no value
    ("r*A/(group_std(sg(r)) + 1)", "group", ("groups",)),        # the policy under sg still reads it
    ("r*group_mean(sum_pi_sq)*A", "group", ("groups",)),         # Σ π² moves with the policy
    ("r*A + group_mean(H)", "group", ("groups",)),
    ("sg(min(r, batch_mean(sg(r))))*A*log(π)", "batch", ("batch",)),
    ("group_mean(seq_sum(log(r)))*A + batch_mean(A)*r", "group", ("groups", "batch")),
]


@pytest.mark.parametrize("text, width, whole", LOCALITY)
def test_an_objectives_locality_is_the_widest_reduction_its_policy_passes_through(text, width, whole):
    obj = dsl.parse(text)
    assert obj.locality() == locality(obj.expr) == width
    assert kept_whole(obj.expr) == whole


@pytest.mark.parametrize("text, policy, gradient", [
    ("group_mean(r)*A", True, True), ("group_mean(sg(r))*r*A", True, False), ("group_mean(A)*r", False, False),
    ("r*A*batch_count(r)", False, False), ("prefix_sum(H)*r", True, True), ("seq_sum(sum_pi_sq)*r", True, False),
    ("sg(batch_mean(r))*r*A", True, False), ("exp(sg(prefix_sum(log(r)) - log(r)) + log(r))*A", True, False),
])
def test_each_reduction_says_whether_it_reads_the_policy_and_passes_a_gradient(text, policy, gradient):
    (found,) = reductions(dsl.parse(text).expr)
    assert (found.policy, found.gradient) == (policy, gradient)


def test_a_group_or_batch_reduction_reads_its_arguments_level():
    found = {r.node.op: r.level for r in reductions(dsl.parse("r*(group_mean(A) + batch_mean(seq_len))").expr)}
    assert found == {"group_mean": "token", "batch_mean": "response"}


# ---------------------------------------------------------------- the analysis's stated point
@pytest.mark.parametrize("text, view", [
    # prefix_sum(x) = p·x at position p; group_sum = G·x, group_std = 0, group_count = G; a token-level
    # batch reduction counts the batch's N·|y| tokens, a response-level one its N responses
    ("exp(prefix_sum(log(r)))*A", "exp(p * log(r)) * A"),
    ("r*(A - group_mean(A)) + group_std(r) + group_count(A)", "r * (A - A) + 0 + G"),
    ("r*A*batch_mean(A) + batch_sum(seq_mean(r)) + batch_count(r)", "r * A * A + N * r + N * seq_len"),
    ("sg(min(r, batch_sum(sg(r))/batch_count(A)))*A*log(π)", "sg(min(r, N * seq_len * sg(r) / (N * seq_len))) * A * log(π)"),
    ("r*A - exp(log(π_ref) - log(π)) + 0.1*H + sum_pi_sq",
     "r * A - exp(log(μ * ρ_ref) - log(π)) + 0.1 * H + sg(π^2 + (1 - π)^2)"),
])
def test_the_analysis_holds_the_third_version_at_a_stated_point(text, view):
    assert render(uniform_view(dsl.parse(text).expr, "old")) == view
