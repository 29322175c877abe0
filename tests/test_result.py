"""The analysis result is a declared structure (openrlhf_drpo.analysis.result.Analysis): the JSON and the report
iterate its declarations, each warning is a record (analysis.alerts) that analysis.present.alert_text words, and
the result still reads like the dict analyze() returned before."""
from dataclasses import fields

import pytest
import sympy as sp

import dsl
import openrlhf_drpo.analysis.present.report as report_module
from openrlhf_drpo.analysis.present.alert_text import TEXT, alert_text
from openrlhf_drpo.analysis.alerts import KINDS, Alert
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.present.report import LINES, report, to_json
from openrlhf_drpo.analysis.result import Analysis


@pytest.fixture(scope="module")
def drpo():
    return analyze(dsl.load("drpo"))


def test_the_json_is_each_declared_field_under_its_name_in_declaration_order(drpo):
    declared = [f.metadata["json"] for f in fields(Analysis) if f.metadata["json"]]
    optional = [f.metadata["json"] for f in fields(Analysis) if f.metadata["optional"]]
    assert declared == [
        "name", "params", "options", "symbols", "scope", "objective", "locality", "memory", "advantage", "weight", "entropy",
        "reference",
        "cases", "boundary", "reachable",
        "claims", "weight_range", "bounded", "smooth", "geometry", "on_policy", "arbiter", "warnings",
        "self_check", "admissibility", "notes", "scenarios", "scenario", "hang_guard", "text"]
    # the channels of H and π_ref are there only where the objective reads them (tests/test_analysis_v3.py),
    # the scenarios where it has one or an indicator, the scenario where one is chosen (tests/test_scenarios.py)
    assert optional == ["memory", "advantage", "entropy", "reference", "scenarios", "scenario"] and \
        list(to_json(drpo)) == [k for k in declared if k not in optional]
    assert to_json(drpo)["symbols"] == ["r", "mu", "A", "delta"] == drpo.symbols      # derived when built


def test_every_report_line_is_a_declared_fields_and_every_evidence_a_claim(drpo):
    lines = {f.metadata["line"] for f in fields(Analysis) if f.metadata["line"]}
    assert lines == set(LINES)
    assert {f.metadata["evidence"] for f in fields(Analysis) if f.metadata["evidence"]} <= set(drpo.claims)
    text = report(drpo, width=None)
    assert text.startswith("drpo — ") and "\n  range      w ∈ [0.92, 1.08]  (bounded; " in text


def test_a_declared_line_the_report_lacks_fails_instead_of_vanishing(drpo, monkeypatch):
    monkeypatch.setattr(report_module, "LINES", {k: v for k, v in LINES.items() if k != "smooth"})
    with pytest.raises(TypeError, match=r"analysis.result declares report lines .*'smooth'.*, analysis.present.report has"):
        report(drpo, width=None)


def test_warnings_are_records_that_the_json_and_the_report_word(drpo):
    (alert,) = [a for a in drpo.warnings if a.kind == "unreachable"]
    mu = sp.Symbol("mu", positive=True)
    assert alert.values["adv"] == "positive" and alert.values["pis"] == [mu + sp.Rational(25, 2)]
    # the range is the bounded line's claim, at its own evidence level: the warning does not restate it
    assert "lo" not in alert.values and "hi" not in alert.values
    text = alert_text(alert)
    assert text.startswith("the boundary for A > 0 (π = μ + 12.5) is unreachable")
    assert to_json(drpo)["warnings"] == [alert_text(a) for a in drpo.warnings] and f"  worry         ! {text}" in report(drpo, width=None)


def test_every_alert_kind_has_its_words_and_an_unknown_kind_is_refused():
    assert set(TEXT) == set(KINDS)
    with pytest.raises(ValueError, match="unknown alert kind 'bogus'"):
        Alert("bogus")


def test_the_result_still_reads_like_the_dict_it_was(drpo):
    assert drpo["_w"] is drpo.w and drpo["_w_numeric"] is drpo.w_numeric and drpo["boundary"] is drpo.boundary
    assert drpo["warnings"] == to_json(drpo)["warnings"] and drpo.get("warnings") == drpo["warnings"]
    assert drpo.get("no such field", "absent") == "absent"
    with pytest.raises(KeyError, match="^'no such field'$"):
        drpo["no such field"]
    renamed = analyze(dsl.load("ppo"))
    renamed["name"] = "ppo (ε = 0.2)"          # as drpo-lab labels its rows
    assert renamed.name == "ppo (ε = 0.2)" and to_json(renamed)["name"] == "ppo (ε = 0.2)"
