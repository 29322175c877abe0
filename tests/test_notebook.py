"""The analysis in a notebook: `analyze` is public (no torch), its result renders in IPython as the
report with its plot (markdown and HTML) and gives drpo-analyze --json's JSON, and the loop
"edit a formula, analyse, look" is one call each."""
import base64
import html
import json
import subprocess
import sys

import pytest
from IPython.core.formatters import DisplayFormatter

import dsl
import openrlhf_drpo
from openrlhf_drpo.analysis.report import report, to_json


@pytest.fixture(scope="module")
def drpo():
    return openrlhf_drpo.analyze("drpo", delta=0.2)


def test_analyze_is_public_and_needs_no_torch():
    code = "import sys, openrlhf_drpo; r = openrlhf_drpo.analyze('ppo'); print(r.name, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "ppo False\n"


def test_a_result_renders_in_ipython_as_its_report_and_its_plot(drpo):
    shown, _ = DisplayFormatter().format(drpo)
    assert set(shown) == {"text/plain", "text/html", "text/markdown"}
    assert shown["text/plain"] == "<Analysis of drpo: w = 1 + μ·(1 − r)·sign(A)/δ; 0 warning(s)>"
    head, png = shown["text/html"].split('<img alt="w over (μ, π)" src="data:image/png;base64,')
    assert html.unescape(head) == "<pre>" + report(drpo) + "</pre>" and "<" not in head[5:-6]
    assert base64.b64decode(png.rstrip('"/>')).startswith(b"\x89PNG")
    assert shown["text/markdown"].startswith(f"```text\n{report(drpo)}\n```\n\n![w over (μ, π)](data:image/png;base64,")


def test_to_json_is_drpo_analyzes_json(drpo, tmp_path):
    cli = subprocess.run([sys.executable, "-m", "openrlhf_drpo.cli", "drpo:delta=0.2", "--json"], capture_output=True,
                         text=True, check=True).stdout
    assert drpo.to_json() == to_json(drpo) == json.loads(cli)


@pytest.mark.parametrize("spec, kwargs, params", [
    ("drpo:delta=0.3", {}, {"delta": 0.3}), ("drpo", {"δ": 0.3}, {"delta": 0.3}), ("spo", {}, {"eps": 0.2}),
    (dsl.parse("ε = 0.1\nr*A - |A|*(r-1)^2/ε"), {"eps": 0.5}, {"eps": 0.5}),
])
def test_an_objective_is_named_as_on_the_command_line_or_given_and_takes_keyword_parameters(spec, kwargs, params):
    assert openrlhf_drpo.analyze(spec, **kwargs).params == params


def test_a_bad_parameter_is_the_languages_located_error():
    with pytest.raises(dsl.DslError, match="unknown parameter 'foo' for objective 'drpo'"):
        openrlhf_drpo.analyze("drpo", foo=1)
