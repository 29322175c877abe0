"""The documentation is tested: every command and example in README.md and docs/*.md that a test
can run is run here, and the output a page shows is the output produced.

A page's fenced blocks, by their info string:
- `dsl`: an objective, which must load; `dsl NAME.dsl`: a file, written where the page's
  commands run (it may hold a mistake on purpose);
- `console`: `$ COMMAND` lines, each followed by its exact output (stdout, then stderr); a line
  `...` stands for any run of lines, one ending in ` ...` for any line that begins with the rest.
  COMMAND is drpo-analyze, drpo-train, drpo-lab or python3, and each exits 0, or N where the
  block says `console exit=N`;
- `python`: runs to exit 0; when the next block is `output`, its stdout must equal it;
- `bash`: its `drpo-analyze` lines run and exit 0. The rest (set-up, training, the lab) is run
  end to end by tests/test_pipeline.py, tests/test_lab.py and CI itself.
With UPDATE_DOCS=1, a console or output block that differs is rewritten with what was produced
(a developer's tool: the suite's tree check then fails the run on purpose)."""
import itertools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

import dsl
from dsl import library

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MODULES = {"drpo-analyze": "openrlhf_drpo.cli", "drpo-train": "openrlhf_drpo.hosts.openrlhf.train", "drpo-lab": "openrlhf_drpo.lab"}
RUN = ("dsl", "console", "python", "bash")


def blocks(page):
    """(info words, text, line number of the opening fence) of each fenced block, also one
    indented inside a list item."""
    out, lines, i = [], page.read_text(encoding="utf-8").split("\n"), 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
            j = lines.index(indent + "```", i + 1)
            text = "".join(line[len(indent):] + "\n" for line in lines[i + 1:j])
            out.append((lines[i].lstrip()[3:].split(), text, i + 1))
            i = j
        i += 1
    return out


def cases():
    for page in PAGES:
        found = blocks(page)
        for k, (info, text, line) in enumerate(found):
            if info and info[0] in RUN and not (info[0] == "dsl" and len(info) > 1):
                following = found[k + 1] if k + 1 < len(found) and found[k + 1][0][:1] == ["output"] else None
                yield pytest.param(page, info, text, line, following, id=f"{page.relative_to(ROOT)}:{line}")


def workdir(page, tmp_path):
    """Where a page's commands run: a fresh folder holding the page's named files."""
    for info, text, _ in blocks(page):
        if info[:1] == ["dsl"] and len(info) > 1:
            (tmp_path / info[1]).write_text(text, encoding="utf-8")
    return tmp_path


def command(line):
    words = shlex.split(line, comments=True)      # `$ cmd  # a remark` on a page
    if words[0] in MODULES:
        return [sys.executable, "-m", MODULES[words[0]], *words[1:]]
    assert words[0] == "python3", f"a console block runs drpo-analyze, drpo-train, drpo-lab or python3, not {words[0]}"
    return [sys.executable, *[str(ROOT / w) if w.startswith(("benchmarks/", "examples/")) else w for w in words[1:]]]


def run(argv, cwd, **kwargs):
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(ROOT)}    # argparse wraps at COLUMNS
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, **kwargs)


def matches(expected: list[str], got: list[str]) -> bool:
    """Line by line, where an expected `...` line stands for any run of lines, and a line that
    ends in ` ...` for any line that begins with the rest."""
    if not expected:
        return not got
    if expected[0].strip() == "...":
        return any(matches(expected[1:], got[k:]) for k in range(len(got) + 1))
    head = expected[0][:-4] if expected[0].endswith(" ...") else None
    same = got and (got[0].startswith(head) if head is not None else expected[0] == got[0])
    return bool(same) and matches(expected[1:], got[1:])


def rewrite(page, old, new):
    # (an empty old would be found at the page's start: the output would land there)
    assert old.strip(), f"{page.name}: an empty output block; write a line in it for UPDATE_DOCS to replace"
    if os.environ.get("UPDATE_DOCS"):
        page.write_text(page.read_text(encoding="utf-8").replace(old, new, 1), encoding="utf-8")


@pytest.mark.parametrize("page, info, text, line, following", list(cases()))
def test_each_example_in_the_docs_runs_and_shows_its_real_output(page, info, text, line, following, tmp_path):
    kind, cwd = info[0], workdir(page, tmp_path)
    if kind == "dsl":
        dsl.parse(text)         # raises its located error if the example is wrong
    elif kind == "python":
        proc = run([sys.executable, "-c", text], cwd)
        assert proc.returncode == 0, proc.stderr
        if following is not None:
            rewrite(page, following[1], proc.stdout)
            assert proc.stdout == following[1], proc.stdout
    elif kind == "bash":
        for cmd in [c.split("#")[0] for c in text.splitlines() if c.startswith("drpo-analyze ")]:
            proc = run(command(cmd), cwd)
            assert proc.returncode == 0, (cmd, proc.stderr)
    else:
        before, *parts = re.split(r"^\$ (.*)\n", text, flags=re.M)
        assert parts and not before, "a console block starts with a `$ COMMAND` line"
        procs = [run(command(cmd), cwd, stdin=subprocess.DEVNULL) for cmd in parts[::2]]
        expected_exit = int(next((w[5:] for w in info if w.startswith("exit=")), 0))
        assert [proc.returncode for proc in procs] == [expected_exit] * len(procs), (info, [p.stderr for p in procs])
        # a page shows a shipped file's path as it prints from the checkout's root (this runs in
        # a folder of its own, where it prints the file's absolute path)
        outputs = [(proc.stdout + proc.stderr).replace(f"{ROOT}/objectives/", "objectives/") for proc in procs]
        if not any(line.endswith("...") for line in text.splitlines()):
            rewrite(page, text, "".join(f"$ {cmd}\n{out}" for cmd, out in zip(parts[::2], outputs)))
        for cmd, shown, out in zip(parts[::2], parts[1::2], outputs):
            assert "Traceback" not in out, out
            assert matches(shown.splitlines(), out.splitlines()), f"{cmd}: the page shows\n{shown}\nthe command printed\n{out}"


def test_every_page_has_an_example_a_test_runs():
    for page in PAGES:
        assert any(info and info[0] in RUN for info, _, _ in blocks(page)), page.name


def test_the_library_table_is_the_objective_files_own_headers():
    page = (ROOT / "docs" / "library.md").read_text(encoding="utf-8")
    assert library.library_table() in page, "docs/library.md: paste library.library_table()\n" + library.library_table()


def test_every_link_between_pages_names_a_page_that_exists():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), (page.name, target)


# a repository path in a page: starts at one of the top-level folders, or at one of the package's
# own (core/loss.py is openrlhf_drpo/core/loss.py); a path named just after another project
# (TRL's docs/source/...) is that project's
TOP = ("dsl", "openrlhf_drpo", "objectives", "examples", "tests", "docs", "benchmarks", "scripts", ".ci")
INSIDE = ("core", "analysis", "hosts", "lab")
PATH = re.compile(r"(?<![\w./:~-])((?:[\w.-]+/)+[\w.-]*)")
OTHERS = re.compile(r"\b(TRL|verl|OpenRLHF|vLLM|DeepSpeed|Ray|NeMo-RL|prime-rl|AReaL)\b[^`|]{0,30}$")


def repository_paths(page):
    for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        for m in PATH.finditer(line):
            top = m.group(1).split("/")[0]
            if top in TOP + INSIDE and not OTHERS.search(line[:m.start()]):
                yield i, m.group(1).rstrip("."), top in INSIDE


def missing_paths(page):
    return [f"{page.name}:{i}: {path}" for i, path, inside in repository_paths(page)
            if not (ROOT / "openrlhf_drpo" / path if inside else ROOT / path).exists()]


@pytest.mark.parametrize("page", PAGES + [ROOT / "CHANGELOG.md"], ids=lambda p: p.name)
def test_every_repository_path_a_page_names_exists(page):
    missing = missing_paths(page)
    assert not missing, "\n".join(missing)


def test_the_path_check_flags_a_moved_file_and_passes_another_projects(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("The derivation (`dsl/symbolic.py`) and `openrlhf_drpo/analysis/symbolic/derivation.py`, `core/gone.py`;\n"
                    "as TRL documents it (docs/source/grpo_trainer.md), and objectives/drpo.dsl.\n")
    assert missing_paths(page) == ["page.md:1: dsl/symbolic.py", "page.md:1: core/gone.py"]


VERL_LOADS = """
import json, sys
from hydra import compose, initialize_config_dir
from verl.trainer.ppo import core_algos
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import import_external_libs
with initialize_config_dir(config_dir=sys.argv[1], version_base=None):
    cfg = compose("verl_drpo")                   # what main_ppo's --config-name verl_drpo loads
actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)     # verl's own checks of the actor's config
import_external_libs("openrlhf_drpo.verl")       # what VERL_USE_EXTERNAL_MODULES does
loss = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode).args[0]      # as verl's actor looks it up
print(json.dumps({"config": type(actor).__name__, "loss_mode": actor.policy_loss.loss_mode,
                  "agg": actor.loss_agg_mode, "objective": loss.objective.name,
                  "params": {k: str(v) for k, v in loss.objective.params.items()}}))
"""


def test_the_verl_configuration_on_the_hosts_page_is_the_example_file_and_verls_loader_trains_it(tmp_path):
    # in verl's venv (tests/test_verl.py says why it is its own): Hydra composes the page's file
    # over verl's ppo_trainer, verl builds its actor config and looks the loss up
    from test_verl import VERL_PYTHON
    page = (ROOT / "docs" / "hosts.md").read_text(encoding="utf-8")
    shown = re.search(r"```yaml\n(.*?)```", page, re.S).group(1)
    assert shown == (ROOT / "examples" / "verl_drpo.yaml").read_text(encoding="utf-8")
    (tmp_path / "verl_drpo.yaml").write_text(shown, encoding="utf-8")
    assert VERL_PYTHON.exists(), f"{VERL_PYTHON} is missing: run bash scripts/setup_verl.sh"
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    proc = subprocess.run([str(VERL_PYTHON), "-c", VERL_LOADS, str(tmp_path)], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(ROOT)}, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {
        "config": "FSDPActorConfig", "loss_mode": "dsl:drpo?delta=0.2", "agg": "token-mean", "objective": "drpo",
        "params": {"delta": "1/5"}}


def test_the_readme_is_at_most_250_lines():
    # the front page is for a newcomer: reference tables and every detail belong on docs/ pages
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move reference material to a docs/ page"


def test_every_function_of_the_language_is_documented():
    from dsl.operations import FUNCTIONS
    page = (ROOT / "docs" / "language.md").read_text(encoding="utf-8")
    missing = [name for name in FUNCTIONS if not re.search(rf"`{name}[`(]|\b{name}\b", page)]
    assert not missing, f"docs/language.md does not describe: {missing}"


# The README's first screen: each claim of where the project has been checked, the file it names
# for it, and what in that file holds it (issue 40 item 6: every such claim shown by a test or a
# benchmark of the project's own)
FRONT_CLAIMS = [
    ("pipeline (Ray, DeepSpeed, vLLM) runs it on a CPU", "tests/test_pipeline.py",
     "def test_drpo_train_runs_the_whole_pipeline_on_cpu"),
    ("`PolicyLoss` in its 48 configurations", "tests/test_sequence.py", "assert sum(map(_valid, CONFIGS)) == 48"),
    ("`GRPOTrainer` step by step", "tests/test_trl.py", "def test_grpo_clip_higher_logs_trls_own_loss_and_reward_step_by_step"),
    ("every `loss_agg_mode`", "tests/test_verl.py", '"seq-mean-token-sum", "seq-mean-token-sum-norm"]'),
    ("H100, the 47 objectives shipped then matched a float64 reference in fp32 and bf16", "docs/benchmarks.md",
     "all 47 shipped objectives, plain and fused"),
]


@pytest.mark.parametrize("claim, path, evidence", FRONT_CLAIMS, ids=[c[2][:30] for c in FRONT_CLAIMS])
def test_each_claim_on_the_readmes_first_screen_names_the_file_that_holds_it(claim, path, evidence):
    screen = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## ", 1)[0]
    said = " ".join(p for p in re.split(r"\n\s*\n", screen) if " ".join(claim.split()) in " ".join(p.split()))
    assert said, f"the README's first screen no longer says {claim!r}"
    named = {f"tests/{m}" if not m.startswith(("tests/", "docs/")) else m
             for m in re.findall(r"\b((?:tests/|docs/)?test_\w+\.py|docs/\w+\.md)", said)}
    assert path in named, f"{claim!r}: its paragraph names {sorted(named)}, not {path}, which holds it"
    assert evidence in (ROOT / path).read_text(encoding="utf-8"), f"{path} no longer holds {claim!r}"


# TRL's own arguments for a one-step run on a CPU, added to the README's call by the test below
ONE_STEP = ("GRPOConfig(output_dir='trainer', use_cpu=True, per_device_train_batch_size=4, num_generations=4, "
            "max_completion_length=4, max_steps=1, logging_steps=1, report_to='none', save_strategy='no', "
            "bf16=False, disable_tqdm=True, dataloader_num_workers=0)")


def test_the_readmes_trl_snippet_trains_as_written_with_a_tiny_local_model(tmp_path):
    """The front page's TRL block, run as written but for its model (a tiny Llama built here:
    tests download nothing) and TRL's args (one short step): its names exist, its call is one
    ObjectiveGRPOTrainer accepts, and it trains."""
    import ast
    snippet = next(text for info, text, _ in blocks(ROOT / "README.md")
                   if info[:1] == ["py"] and "ObjectiveGRPOTrainer(" in text)
    assert len(snippet.splitlines()) <= 12, "the front page's TRL snippet is about 10 lines"
    tree = ast.parse(snippet)
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "ObjectiveGRPOTrainer")
    given = {k.arg: k.value for k in call.keywords}
    assert set(given) == {"model", "reward_funcs", "train_dataset", "objective"} and given["objective"].value == "drpo"
    assert ast.unparse(tree.body[-1]) == "trainer.train()"
    given["model"].value = "model"
    call.keywords.append(ast.keyword("args", ast.parse(ONE_STEP, mode="eval").body))
    script = "\n".join([
        "import torch",
        "from openrlhf_drpo.lab.toytask import SPECIAL, WORDS, tiny_llama",
        "model, _, _ = tiny_llama('.', SPECIAL + WORDS, hidden=16)",
        "model.save_pretrained('model')",
        "torch.manual_seed(0)",
        "from trl import GRPOConfig",
        ast.unparse(ast.fix_missing_locations(tree)),
        "print('steps', trainer.state.global_step, 'reward' in trainer.state.log_history[0])"])
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "steps 1 True", proc.stdout[-2000:]


# ------------------------------------------------ where things ran, and the paths commands show
DEVICE = r"(?:NVIDIA )?(H100|H200|A100|B200|GPUs?)"
RAN_ON = re.compile(rf"\b(?:ran|run|runs|been run|checked|measured|matched)\b[^.;]{{0,80}}?\bon (?:an? |the )?{DEVICE}")
RECORDS = "docs/benchmarks.md"      # where each run on a GPU is recorded, under "Measured ... on an NVIDIA <device>"
# what a page must not say while RECORDS holds a run on a GPU
DENIES = re.compile(r"\bno GPU (?:machine )?(?:was|has been|is) (?:ever )?(?:used|lent|at hand|available)\b|"
                    r"\bno GPU was ever\b|\bnever (?:ran|run) on (?:a|any) GPU\b", re.I)


def gpu_run_claims(text: str):
    """(device, paragraph, names the records) for each claim that something ran on a GPU (not
    those that say it did not), paragraph by paragraph."""
    for paragraph in (" ".join(p.split()) for p in re.split(r"\n\s*\n", text)):
        for m in RAN_ON.finditer(paragraph):
            sentence = re.split(r"(?<=[.;:])\s", paragraph[:m.start()])[-1] + m.group(0)
            if not re.search(r"\b(?:not|never|no|nor)\b", sentence, re.I):
                yield m.group(1), paragraph, bool(re.search(r"(?:docs/|\()benchmarks\.md", paragraph))


def denials(text: str) -> list[str]:
    return DENIES.findall(" ".join(text.split()))


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "benchmarks.md"], ids=lambda p: p.name)
def test_each_claim_of_a_run_on_a_gpu_names_the_file_that_records_it(page):
    records = (ROOT / RECORDS).read_text(encoding="utf-8")
    for device, paragraph, named in gpu_run_claims(page.read_text(encoding="utf-8")):
        assert named, f"{page.name}: says something ran on {device} without naming {RECORDS}: {paragraph[:200]}"
        if not device.startswith("GPU"):
            assert re.search(rf"^### Measured[^\n]* on an NVIDIA {device}\b", records, re.M), (page.name, device)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_says_no_gpu_was_used_while_the_records_hold_runs_on_one(page):
    assert re.search(r"^### Measured[^\n]* on an NVIDIA ", (ROOT / RECORDS).read_text(encoding="utf-8"), re.M)
    assert not denials(page.read_text(encoding="utf-8")), page.name


def test_the_gpu_claim_checks_flag_what_the_pages_once_said():
    """The sentences issue 47 found, and a claim that names no record: each is caught."""
    assert denials("**Not yet run on a GPU.** No GPU machine was lent to the sessions that built this")
    assert denials("No GPU figure has been measured: no GPU was at hand.")
    assert [c[2] for c in gpu_run_claims("the loss core and TRL's loss have run on an H100.")] == [False]
    assert [c[2] for c in gpu_run_claims("the loss core ran on an H100 (docs/benchmarks.md).")] == [True]
    assert list(gpu_run_claims("drpo-train has not run on a GPU yet; verl's main_ppo was not run here")) == []


COMMANDS = {"drpo-train", "drpo-analyze", "drpo-lab", "python3", "python", "bash", "pip", "torchrun", "ray"}


def absolute_paths_in_commands(text: str) -> list[str]:
    """The words of each command line shown in a fenced block (`$ ...`, or a line that starts with
    a command, after VAR=value settings) that are absolute paths: one machine's, not a reader's."""
    found = []
    for line in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        for command in line.splitlines():
            words = command.strip().removeprefix("$ ").split()
            settings = list(itertools.takewhile(lambda w: re.fullmatch(r"[A-Z_]+=\S*", w), words))
            if words[len(settings):][:1] and words[len(settings)] in COMMANDS:
                found += [w for w in words if re.match(r"(?:[\w.-]+=)?(?:/|~/)", w) and "://" not in w]
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_recorded_command_holds_an_absolute_path(page):
    assert not absolute_paths_in_commands(page.read_text(encoding="utf-8")), page.name


def test_the_command_path_check_flags_the_two_node_record_as_it_was():
    old = ("```text\n$ python3 examples/two_node_cpu.py --out /tmp/scale-nodes-run\n"
           "RAY_ADDRESS=192.0.2.2:33705 drpo-train --drpo.objective /tmp/objective-uv_c52uh/my_objective.dsl "
           "--reward.remote_url /work/wt/scale-nodes/openrlhf_drpo/lab/toytask.py\n"
           "log: /tmp/scale-nodes-run/train.log\n```\n")
    assert absolute_paths_in_commands(old) == ["/tmp/scale-nodes-run", "/tmp/objective-uv_c52uh/my_objective.dsl",
                                               "/work/wt/scale-nodes/openrlhf_drpo/lab/toytask.py"]
    assert absolute_paths_in_commands("```bash\nTORCH_INDEX=https://x.org/cpu bash scripts/setup.sh --out OUT\n```\n") == []


PACKAGES = ("dsl", "openrlhf_drpo")


def layout_rows(text: str) -> dict[str, str]:
    """api.md's "Repository layout" table: each row's package folder (`openrlhf_drpo/analysis/numeric/`)
    and the rest of its row."""
    table = text.split("## Repository layout", 1)[1]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `((?:dsl|openrlhf_drpo)/(?:[\w]+/)*)` \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def unnamed_modules(text: str) -> list[str]:
    """Each module of the two packages (from the files, as tests/test_layers.py takes them) that its
    folder's row in the layout table does not name as `name`."""
    rows = layout_rows(text)
    sources = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if not p.stem.startswith("__"))
    return [str(p.relative_to(ROOT)) for p in sources
            if f"`{p.stem}`" not in rows.get(p.parent.relative_to(ROOT).as_posix() + "/", "")]


def test_the_layout_table_names_every_module_of_both_packages():
    missing = unnamed_modules((ROOT / "docs" / "api.md").read_text(encoding="utf-8"))
    assert not missing, "docs/api.md's layout table does not name, in its folder's row: " + ", ".join(missing)


def test_the_layout_check_flags_a_module_its_row_leaves_out():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert unnamed_modules(text.replace("`arbiter`", "the arbiter")) == ["openrlhf_drpo/analysis/numeric/arbiter.py"]
