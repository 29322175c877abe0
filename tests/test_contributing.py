"""docs/contributing.md's recipes, followed on a throwaway example in a temporary copy of the
repository with the page's own blocks: a toy atom, a toy host and a toy report field are each
picked up by everything the page says picks them up, and each check fails before its edit."""
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "contributing.md"


def block(label: str) -> str:
    """The text of the page's fenced block whose info string ends with `label`."""
    found = re.findall(r"^```\w+ " + re.escape(label) + r"\n(.*?)^```$", PAGE.read_text(encoding="utf-8"),
                       re.S | re.M)
    assert len(found) == 1, label
    return found[0]


def insert(path: pathlib.Path, text: str, before: str = None, after: str = None) -> None:
    """`text` on its own lines before the first line containing `before` (or after the first
    containing `after`; at the end with neither)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    anchor = before or after
    if anchor is None:
        index = len(lines)
    else:
        index = next(i for i, line in enumerate(lines) if anchor in line) + (after is not None)
    lines[index:index] = text.rstrip("\n").split("\n")
    path.write_text("\n".join(lines), encoding="utf-8")


def copy_of_repo(dest: pathlib.Path) -> pathlib.Path:
    """The checkout (the package, its docs, the tests the recipes name with their golden reports,
    and the build files, as test_language installs it) in the temporary folder `dest`."""
    dest = dest / "repo"
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".hypothesis",
                                                              ".pytest_cache", ".benchmarks", "runs", ".venv*", ".whl",
                                                              ".gpuwhl"))
    return dest


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    return copy_of_repo(tmp_path_factory.mktemp("repo"))


def run(copy, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=copy, capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"})


def pytest_in(copy, *args) -> subprocess.CompletedProcess:
    # the copy's Hypothesis profile is this run's (CI's is derandomized)
    env = {"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin", **{k: os.environ[k] for k in ("CI",) if k in os.environ}}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=copy,
                          capture_output=True, text=True, timeout=600, env=env)


ATOM = """
import json, torch
import dsl
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.present.report import to_json
from openrlhf_drpo.core import CompiledLoss
obj = dsl.parse("cube(r)*A/3", "toy.dsl")
res = to_json(analyze(obj))
g = torch.Generator().manual_seed(0)
logp = -torch.rand(3, 5, generator=g, dtype=torch.float64)
old, A = logp - 0.1 * torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)
grads = []
for fused in (True, False):
    x = logp.clone().requires_grad_()
    CompiledLoss(obj, fused=fused)(x, old, A)[0].backward()
    grads.append(x.grad)
r = torch.exp(logp - old)
hand = -(A * r**3) / 15       # d(−mean of r³A/3)/d log π = −r³·A/15 over 15 tokens
print(json.dumps({"weight": res["weight"], "claim": res["claims"]["smooth"]["status"],
                  "fused": torch.allclose(grads[0], hand, rtol=1e-12), "plain": torch.allclose(grads[1], hand, rtol=1e-12)}))
"""


def test_an_atom_added_as_the_page_says_parses_is_analysed_lowers_both_ways_and_is_documented(copy):
    assert "unknown function 'cube'" in run(copy, ATOM).stderr          # before: not in the language
    docs_check = ("tests/test_docs.py", "-k", "every_function_of_the_language_is_documented")
    insert(copy / "dsl/operations.py", block("atom-row"), before="# x/(1 + |x|): nan at ±inf")
    insert(copy / "openrlhf_drpo/core/kernel_table.py", block("atom-kernel"),
           before='**{k: Kernel(reuses_args=True) for k in ("min", "max", "clip")}')
    proc = run(copy, ATOM)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"weight": "r**2", "claim": "proven", "fused": True, "plain": True}, out
    undocumented = pytest_in(copy, *docs_check)
    assert undocumented.returncode == 1 and "cube" in undocumented.stdout, undocumented.stdout[-2000:]
    insert(copy / "docs/language.md", block("atom-doc"), after="- `softsign(x)`:")
    assert pytest_in(copy, *docs_check).returncode == 0


def test_a_reduction_added_as_the_page_says_needs_its_adjoint_and_the_generated_tests_check_it(tmp_path):
    """The toy seq_std: without its adjoint the row is refused on import; with another row's
    (seq_mean's) the generated tests fail; with its own they pass.
    In a copy of its own (its broken rows stay out of the others')."""
    copy = copy_of_repo(tmp_path)
    ops, row = copy / "dsl/operations.py", block("reduction-row")
    bare = row.split(", adjoint=")[0] + "),"
    insert(ops, bare, before="# prefix_sum's adjoint (not in the language)")
    insert(copy / "openrlhf_drpo/core/reductions.py", block("reduction-torch"), before="def _all_ranks(t, pg):")
    proc = run(copy, "import dsl.operations")
    assert "TypeError: operation 'seq_std': a reduction declares its adjoint=" in proc.stderr, proc.stderr[-2000:]
    generated = ("tests/test_reductions.py", "tests/test_loss_v3.py", "-k", "seq_std")
    ops.write_text(ops.read_text(encoding="utf-8").replace(bare, row.replace("adj.response_std", "adj.response_mean")),
                   encoding="utf-8")
    proc = pytest_in(copy, *generated)
    assert proc.returncode == 1 and "seq_std r*A*{f}(r) fused=True" in proc.stdout, proc.stdout[-3000:]
    insert(copy / "dsl/adjoints.py", "\n\n" + block("reduction-adjoint"))
    ops.write_text(ops.read_text(encoding="utf-8").replace(row.replace("adj.response_std", "adj.response_mean"), row),
                   encoding="utf-8")
    proc = pytest_in(copy, *generated)
    assert proc.returncode == 0 and "\n7 passed" in proc.stdout, proc.stdout[-3000:]    # 6 generated, 1 definition
    docs_check = ("tests/test_docs.py", "-k", "every_function_of_the_language_is_documented")
    assert pytest_in(copy, *docs_check).returncode == 1
    insert(copy / "docs/language.md", block("reduction-doc"), after="- `softsign(x)`:")
    assert pytest_in(copy, *docs_check).returncode == 0


def follow_the_atom_reduction_and_host_recipes(copy: pathlib.Path) -> None:
    """Every block of the three recipes, where the page says it goes."""
    insert(copy / "dsl/operations.py", block("atom-row"), before="# x/(1 + |x|): nan at ±inf")
    insert(copy / "openrlhf_drpo/core/kernel_table.py", block("atom-kernel"),
           before='**{k: Kernel(reuses_args=True) for k in ("min", "max", "clip")}')
    insert(copy / "docs/language.md", block("atom-doc"), after="- `softsign(x)`:")
    insert(copy / "dsl/adjoints.py", "\n\n" + block("reduction-adjoint"))
    insert(copy / "dsl/operations.py", block("reduction-row"), before="# prefix_sum's adjoint (not in the language)")
    insert(copy / "openrlhf_drpo/core/reductions.py", block("reduction-torch"), before="def _all_ranks(t, pg):")
    insert(copy / "docs/language.md", block("reduction-doc"), after="- `softsign(x)`:")
    (copy / "openrlhf_drpo/hosts/toy.py").write_text(block("host-module"), encoding="utf-8")
    insert(copy / "tests/test_layers.py", block("host-layer"), before='    "hosts.verl",')


# every test file that reads what the three recipes change, whole: the table's (test_operations,
# test_reductions and test_loss_v3 are generated from it), the parser's (its hints name the
# table's functions) and the layers' (file sizes, the new host's place); and the two pages' examples.
# The rest of the suite, minus the pipelines, passed on such a copy too (by hand: 17 min)
TOUCHED = ["tests/test_operations.py", "tests/test_reductions.py", "tests/test_loss_v3.py", "tests/test_language.py",
           "tests/test_language_v3.py", "tests/test_layers.py"]


def test_the_atom_reduction_and_host_recipes_followed_together_leave_every_test_file_they_touch_passing(tmp_path):
    copy = copy_of_repo(tmp_path)
    follow_the_atom_reduction_and_host_recipes(copy)
    proc = pytest_in(copy, "-rA", *TOUCHED)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "[cube" in proc.stdout and "seq_std" in proc.stdout, proc.stdout[-3000:]     # among the generated rows
    pages = pytest_in(copy, "-rA", "tests/test_docs.py", "-k", "contributing.md or language.md or every_function")
    ran = set(re.findall(r"^PASSED tests/test_docs.py::(\w+)\[?(docs/\w+\.md|\w+\.md)?", pages.stdout, re.M))
    assert pages.returncode == 0 and {("test_each_example_in_the_docs_runs_and_shows_its_real_output", "docs/language.md"),
                                      ("test_every_repository_path_a_page_names_exists", "language.md"),
                                      ("test_every_function_of_the_language_is_documented", "")} <= ran, pages.stdout[-3000:]


HOST = """
import torch
from openrlhf_drpo.hosts.toy import ToyLoss
g = torch.Generator().manual_seed(1)
logp = -torch.rand(2, 4, generator=g, dtype=torch.float64)
old = logp - 0.3 * torch.rand(2, 4, generator=g, dtype=torch.float64)
A = torch.randn(2, 4, generator=g, dtype=torch.float64)
mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
x = logp.clone().requires_grad_()
loss, floats = ToyLoss("drpo", delta=0.2).step(x, old, A, mask, 11.0)
# by hand (objectives/drpo.dsl, δ = 0.2, μ = π_old): the token sum of ℓ = r·A − |A|/(2δ)·μ·(r − 1)²
# over the normalizer 11, negated; no code of the package's
y = logp.clone().requires_grad_()
r = torch.exp(y - old)
hand = -((r * A - A.abs() / 0.4 * torch.exp(old) * (r - 1) ** 2) * mask).sum() / 11.0
(gx,), (gy,) = torch.autograd.grad(loss, x), torch.autograd.grad(hand, y)
assert torch.allclose(loss, hand, rtol=1e-12) and torch.allclose(gx, gy, rtol=1e-10, atol=1e-15), (loss, hand)
assert abs(floats["drpo_ratio_max"] - r[mask.bool()].max().item()) < 1e-6, floats
for name in ("tis_ppo", "trust_the_batch"):      # what the toy host does not provide: refused on construction
    try:
        ToyLoss(name)
    except ValueError as e:
        print(e)
"""


def test_a_host_added_as_the_page_says_takes_its_layer_and_gives_the_objectives_loss_by_hand(copy):
    (copy / "openrlhf_drpo/hosts/toy.py").write_text(block("host-module"), encoding="utf-8")
    layers = ("tests/test_layers.py",)
    assert pytest_in(copy, *layers).returncode == 1         # before: the new module has no place
    insert(copy / "tests/test_layers.py", block("host-layer"), before='    "hosts.verl",')
    proc = pytest_in(copy, *layers)
    assert proc.returncode == 0, proc.stdout[-3000:]
    proc = run(copy, HOST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().split("\n") == [
        "ToyLoss: objective 'tis_ppo' uses π_rollout, but ToyLoss does not provide it (ToyLoss.provides declares no "
        "'rollout_log_probs')",
        "ToyLoss: objective 'trust_the_batch' uses batch_count, batch_sum (the optimizer step's whole batch, in one loss "
        "call or through batch_statistics() over its micro-batches), but the toy host calls the loss once per micro-batch, not on the optimizer step's batch"]


FIELD = """
import json
import dsl
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.present.report import report, to_json
res = analyze(dsl.load("drpo"))
print(json.dumps({"json": to_json(res).get("operations"),
                  "line": [l for l in report(res).splitlines() if l.startswith("  operations")]}))
"""


def test_a_report_field_added_as_the_page_says_reaches_the_json_the_report_the_goldens_and_the_pages(tmp_path):
    copy = copy_of_repo(tmp_path)
    declare = copy / "openrlhf_drpo/analysis/result.py"
    insert(declare, block("field-declare"), before='    notes: list = declared(json="notes", line="notes")')
    proc = run(copy, FIELD)
    assert "declares report lines" in proc.stderr, proc.stderr[-2000:]   # before its line exists: an error
    insert(copy / "openrlhf_drpo/analysis/present/report.py", block("field-line"))
    insert(copy / "openrlhf_drpo/analysis/orchestrator.py", block("field-compute"), after='result["smooth"] = ')
    proc = run(copy, FIELD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # drpo's ∂ℓ/∂r = A − |A|·μ·2(r − 1)/(2δ), 16 operations written out
    assert json.loads(proc.stdout) == {"json": 16, "line": ["  operations 16 in ∂ℓ/∂r, written out"]}, proc.stdout
    pinned = copy / "tests/test_result.py"
    assert pytest_in(copy, str(pinned.relative_to(copy))).returncode == 1     # the pinned field list catches it
    old = '        "self_check", "admissibility", "notes", "scenarios", "scenario", "hang_guard", "text"]'
    assert old in pinned.read_text(encoding="utf-8"), "test_result.py's field list moved: update this recipe"
    pinned.write_text(pinned.read_text(encoding="utf-8").replace(old, block("field-test").rstrip("\n")), encoding="utf-8")
    proc = pytest_in(copy, "tests/test_result.py")
    assert proc.returncode == 0, proc.stdout[-3000:]
    # every report has the line now: the goldens and the pages' reports fail until the page's
    # regeneration runs, and pass after it with the new line in them
    goldens, pages = ("tests/test_arbiter.py", "-k", "golden"), ("tests/test_docs.py", "-k", "analysis.md")
    assert pytest_in(copy, "-x", *goldens).returncode == 1     # (-x: one failing golden shows it)
    for command in block("field-regenerate").splitlines():
        words = shlex.split(command)
        if words[0] == "git":
            continue      # reading the diff is the contributor's
        cut = words.index("python3")
        env = dict(w.split("=", 1) for w in words[:cut])
        subprocess.run([sys.executable, *words[cut + 1:]], cwd=copy, capture_output=True, text=True, timeout=900,
                       env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin", **env})
    for check in (goldens, pages, ("tests/test_layers.py",)):
        proc = pytest_in(copy, *check)
        assert proc.returncode == 0, (check, proc.stdout[-3000:])
    assert re.search(r"^  operations \d+ in ∂ℓ/∂r, written out$",
                     (copy / "tests/golden/clip_plus_penalty.txt").read_text(encoding="utf-8"), re.M)


TOY_STALE = """
import json
import dsl
from openrlhf_drpo.analysis.orchestrator import analyze
from openrlhf_drpo.analysis.present.report import to_json
res = to_json(analyze(dsl.parse("0.001*r*A*exp(-0.1*staleness)", "toy.dsl")))
print(json.dumps({"scenarios": [s["name"] for s in res["scenarios"]["scenarios"]],
                  "few": [s["text"] for s in res["scenarios"]["scenarios"] if s["name"] == "few-versions"],
                  "tiny": [w for w in res["warnings"] if "is at most" in w], "claim": res["claims"].get("on_policy")}))
"""


def test_a_scenario_an_alert_and_a_claim_added_as_the_page_says_reach_the_result_and_its_pinning_tests(copy):
    """One pytest run before the second half of each edit (the pinned scenario list, the alert's
    words and rule, the claim itself: each pinning test fails) and one after (they pass)."""
    analysis = copy / "openrlhf_drpo/analysis"
    insert(analysis / "batch/scenarios.py", block("scenario-derive"), after='{"held": {"staleness": STALE}})]')
    insert(analysis / "alerts.py", block("alert-kind"), after='    "on policy negative",')
    result = analysis / "result.py"
    old = '    on_policy: dict = declared(json="on_policy", line="on_policy")'
    result.write_text(result.read_text(encoding="utf-8").replace(old, block("claim-declare").rstrip("\n")),
                      encoding="utf-8")
    pinning = ("tests/test_scenarios.py", "tests/test_result.py", "-k",
               "derived_from_the_objectives_constructs or every_alert_kind or every_evidence_a_claim")
    proc = pytest_in(copy, "-rA", *pinning)
    failed = set(re.findall(r"^FAILED tests/\w+\.py::(\w+)", proc.stdout, re.M))
    assert failed == {"test_scenarios_are_derived_from_the_objectives_constructs",
                      "test_every_alert_kind_has_its_words_and_an_unknown_kind_is_refused",
                      "test_every_report_line_is_a_declared_fields_and_every_evidence_a_claim"}, proc.stdout[-3000:]
    pinned = copy / "tests/test_scenarios.py"
    pinned.write_text(pinned.read_text(encoding="utf-8").replace(
        '    ("r*A*exp(-0.1*staleness)", ["fresh", "stale"]),', block("scenario-test").rstrip("\n")), encoding="utf-8")
    insert(analysis / "alerts.py", block("alert-rule"), after="""out.append(Alert(f"on policy {f['status']}", {"adv": adv}))""")
    insert(analysis / "present/alert_text.py", block("alert-words"), before='    "on policy negative": lambda adv:')
    insert(analysis / "claims.py", block("claim-evidence"), before='    if res["bounded"] is None:')
    proc = pytest_in(copy, *pinning)
    assert proc.returncode == 0, proc.stdout[-3000:]
    proc = run(copy, TOY_STALE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["scenarios"] == ["fresh", "stale", "few-versions"], out
    # by hand: w = 0.001·e^(−0.1·staleness) everywhere, at the held staleness 1 and at 4
    assert out["few"] == ["w on policy 0.00067032 for both signs of A (analysed: 0.000904837)"], out
    assert [w.split(":")[0] for w in out["tiny"]] == [f"on policy (r = 1) for A {s} 0, w is at most 0.000904837"
                                                      for s in "><"], out
    assert out["claim"]["status"] == "unconfirmed" and "from 1e-06 to 1" in out["claim"]["evidence"], out
