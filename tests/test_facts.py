"""An objective's facts (its levels, reductions, locality, what a loss call keeps whole), computed
once on the objective and read by the analysis and the compiler alike; a group or batch reduction's
argument level as its own Node field; and the one rebuild helper every rewrite of the IR uses."""
import collections
import sys

import pytest

import dsl
import dsl.levels
from dsl.ir import Node, postorder, rebuild
from dsl.levels import argument_level, levels
from dsl.printing import render
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.core.loss import CompiledLoss
from openrlhf_drpo.core.rewrites import annotate_levels, rewrite_logs, select_masks


def _count_calls(monkeypatch, name: str, nodes: set) -> collections.Counter:
    """Each call of dsl.levels.<name> on the objective or a part of it (`nodes`: a binding's
    statistic is one), by its other arguments, wherever a module bound it."""
    calls, original = collections.Counter(), getattr(dsl.levels, name)

    def counted(root, *rest, **kw):
        if root in nodes:
            calls[repr((rest, sorted(kw)))] += 1
        return original(root, *rest, **kw)
    for module in [m for k, m in sys.modules.items() if k.split(".")[0] in ("dsl", "openrlhf_drpo")]:
        if getattr(module, name, None) is original:
            monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("objective, run", [
    # (the scenarios view each of otb's indicators alone, at each scenario: its levels are the
    # objective's, and the view alone says nothing of its held lines, so it computes no reductions)
    (dsl.load("otb"), analyze),
    (dsl.load("trust_the_batch"), analyze),        # a batch statistic under sg, held as a parameter
    (dsl.parse("r*(A - group_mean(A))/(group_std(A) + 1)"), analyze),    # position by position
    (dsl.load("otb"), CompiledLoss),
    (dsl.load("ctpo"), CompiledLoss),
], ids=["analyze(otb)", "analyze(trust_the_batch)", "analyze(by position)", "CompiledLoss(otb)",
        "CompiledLoss(ctpo)"])
def test_one_analysis_or_compilation_computes_each_fact_of_the_objective_once(monkeypatch, objective, run):
    # before: one analysis of otb computed levels() 19 times and reductions() 13 times on its parts
    dsl.levels.facts.cache_clear()           # no facts computed yet, by this test or another
    nodes = set(objective.expr.walk())
    level_calls = _count_calls(monkeypatch, "levels", nodes)
    reduction_calls = _count_calls(monkeypatch, "reductions", nodes)
    run(objective)
    assert max(level_calls.values(), default=1) == 1, level_calls      # once per question (per_response or not)
    assert sum(reduction_calls.values()) <= 1, reduction_calls


def test_an_objectives_facts_follow_its_expression():
    obj = dsl.load("otb")
    assert obj.facts is obj.facts and obj.with_overrides({"c": 4}).facts is obj.facts
    before = obj.facts
    obj.expr = dsl.parse("r*A").expr           # a new expression: facts of its own, not the old ones
    assert obj.facts is not before and obj.facts.locality == "token" and before.locality == "group"


def test_a_reductions_level_is_its_own_field_equal_to_its_arguments_level():
    expr = dsl.parse("r*(A - group_mean(A))/(group_std(seq_mean(A)) + 1) + 0.1*batch_mean(seq_len)*r + "
                     "group_count(r)").expr
    annotated = annotate_levels(expr, levels(expr))
    found = {(n.op, n.level, n.value) for n in annotated.walk() if n.op.startswith(("group_", "batch_"))}
    assert found == {("group_mean", "token", None), ("group_std", "response", None),
                     ("batch_mean", "response", None), ("group_count", "token", None)}
    assert {n.level for n in annotated.walk() if not n.op.startswith(("group_", "batch_"))} == {None}
    # the level the old code stored in Node.value: argument_level on the un-annotated tree
    old = {n.op: argument_level(n, levels(expr)) for n in expr.walk() if n.op.startswith(("group_", "batch_"))}
    assert {n.op: n.level for n in annotated.walk() if n.level} == old


def test_a_reductions_level_is_part_of_its_identity_and_not_of_its_text():
    a = Node("var", value="A")
    token, response = Node("group_mean", (a,), level="token"), Node("group_mean", (a,), level="response")
    assert token != response and token == Node("group_mean", (a,), level="token")
    assert hash(token) == hash(Node("group_mean", (a,), level="token")) and len({token, response}) == 2
    assert render(token) == render(response) == render(Node("group_mean", (a,))) == "group_mean(A)"
    assert "level='token'" in repr(token)


def test_a_reductions_level_survives_the_rewrites_and_rebuild():
    # each reduction's argument rewritten: log(π_old) is a log-prob, r is replaced below
    expr = dsl.parse("[π_old/μ < 2]*log(r)*(A - group_mean(log(π_old)*A)) + r*batch_mean(seq_mean(r*A))").expr
    annotated = annotate_levels(expr, levels(expr))
    rewritten = select_masks(rewrite_logs(annotated))
    assert rewritten != annotated            # the rewrites did rewrite
    want = {("group_mean", "token"), ("batch_mean", "response")}
    for tree in (rewritten, rebuild(annotated, lambda m, args: Node("var", value="pi") if m.value == "r" else None)):
        assert {(n.op, n.level) for n in tree.walk() if n.level} == want
    assert render(annotated) == render(expr)     # the level is not printed: canonical text unchanged


@pytest.mark.parametrize("name", dsl.shipped_names())
def test_rebuild_keeps_each_kept_nodes_position_and_shares_what_was_shared(name):
    expr = dsl.load(name).expr
    once = rebuild(expr, lambda m, args: None)        # nothing replaced: an equal tree, equal nodes made one
    assert once == expr and rebuild(once, lambda m, args: None) is once
    new = rebuild(expr, lambda m, args: Node("num", value=m.value) if m.op == "var" and m.value == "A" else None)
    # equal nodes (a binding used twice, r*A written twice) are rebuilt once, at the first one's position
    first = {m: m.pos for m in postorder(expr)}
    stack, seen = [(expr, new)], set()
    while stack:
        old, got = stack.pop()
        if (id(old), id(got)) in seen:
            continue
        seen.add((id(old), id(got)))
        if (old.op, old.value) == ("var", "A"):
            assert (got.op, got.value) == ("num", "A")
            continue
        assert (got.op, got.value, got.pos, got.level, len(got.args)) == (old.op, old.value, first[old], old.level,
                                                                            len(old.args))
        stack.extend(zip(old.args, got.args))
    objects, stack = {}, [new]          # every node of the rebuilt tree, once per object
    while stack:
        n = stack.pop()
        if id(n) not in objects:
            objects[id(n)] = n
            stack.extend(n.args)
    assert len(objects) == len(set(objects.values())), "equal nodes rebuilt apart"
