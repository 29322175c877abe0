"""The analysis in a notebook: `analyze` is public (no torch), its result renders in IPython as the
report with its plot (markdown and HTML) and gives drpo-analyze --json's JSON, and the loop
"edit a formula, analyse, look" is one call each."""
import base64
import html
import json
import os
import subprocess
import sys

import pytest
from IPython.core.formatters import DisplayFormatter

import dsl
import openrlhf_drpo
from openrlhf_drpo.analysis.present.report import report, to_json


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
    text = report(drpo).replace(f"\n  {drpo.path}\n", "\n  drpo (shipped)\n", 1)    # the file by its name
    head, svg = shown["text/html"].split('<div title="w over (μ, π)"><svg', 1)
    assert html.unescape(head) == "<pre>" + text + "</pre>" and "<" not in head[5:-6]
    assert svg.endswith("</svg>\n</div>") and "<text" in svg      # a vector picture, its text as text
    start = f"```text\n{text}\n```\n\n![w over (μ, π)](data:image/svg+xml;base64,"
    assert shown["text/markdown"].startswith(start)
    assert base64.b64decode(shown["text/markdown"][len(start):].rstrip(")\n")).decode().startswith("<svg")


@pytest.mark.parametrize("name", ["drpo", "sapo_erf"])      # sapo_erf: the largest of the shipped objectives
def test_the_notebook_forms_are_small_and_hold_no_absolute_path(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)         # outside the checkout: the shipped file's path is absolute
    res = openrlhf_drpo.analyze(name)
    assert os.path.isabs(res.path)
    for form in (res._repr_html_(), res._repr_markdown_()):
        assert len(form.encode()) <= 100_000, len(form.encode())    # the PNG's were 253 KB
        assert res.path not in form and os.path.dirname(res.path) not in form
        assert f"\n  {name} (shipped)\n" in html.unescape(form)


def test_a_users_file_is_shown_relative_to_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "obj.dsl").write_text("r*A\n")
    monkeypatch.chdir(tmp_path)
    res = openrlhf_drpo.analyze(str(tmp_path / "mine" / "obj.dsl"))
    assert f"\n  {os.path.join('mine', 'obj.dsl')}\n" in res._repr_markdown_() and str(tmp_path) not in res._repr_html_()
    assert res.path == str(tmp_path / "mine" / "obj.dsl")     # the result keeps its own path


def test_report_and_print_give_drpo_analyzes_text_and_repr_one_short_line(drpo):
    cli = subprocess.run([sys.executable, "-m", "openrlhf_drpo.cli", "drpo:delta=0.2"], capture_output=True,
                         text=True, check=True).stdout
    assert drpo.report() == str(drpo) == report(drpo) == cli.rstrip("\n")
    assert repr(drpo).count("\n") == 0


def test_the_repr_of_a_long_piecewise_w_stays_one_short_line():
    res = openrlhf_drpo.analyze("trust_the_batch")      # its w is about 600 characters
    assert len(res.text["weight"]) > 300
    assert len(repr(res)) <= 120 and repr(res).startswith("<Analysis of trust_the_batch: w = ")
    assert repr(res).endswith(f" …; {len(res.warnings)} warning(s)>")


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
