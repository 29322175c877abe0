"""drpo-analyze's command line at its edges: every bad argument is a clear message and a
non-zero exit, never a traceback; overrides mean the same here as in a file, the API and
drpo-train; numbers print at a readable length."""
import importlib.metadata
import json
import subprocess
import sys

import pytest

import dsl
import openrlhf_drpo
from dsl.library import header


def drpo_analyze(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "openrlhf_drpo.cli", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("path, message", [
    ("/nonexistent/x.png", "no such directory: /nonexistent"),
    ("w.xyz", "the file name must end in .png, .pdf, .svg"),
    ("", "--plot needs a file name"),
    ("{tmp}", "is a directory; name a file in it"),
    ("w", "the file name must end in"),
])
def test_a_bad_plot_path_is_a_clear_error_before_any_work(tmp_path, path, message):
    proc = drpo_analyze("drpo", "--plot", path.format(tmp=tmp_path), cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == "" and not list(tmp_path.iterdir())


def test_the_plot_goes_to_exactly_the_file_named(tmp_path):
    target = tmp_path / "w.svg"
    proc = drpo_analyze("drpo", "--plot", str(target))
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {target}" in proc.stdout and [p.name for p in tmp_path.iterdir()] == ["w.svg"]


def test_a_reader_that_leaves_early_gets_no_traceback():
    proc = subprocess.run(f"'{sys.executable}' -m openrlhf_drpo.cli drpo ppo spo | head -1", shell=True,
                          capture_output=True, text=True)
    assert proc.stdout.startswith("drpo — ") and proc.stdout.count("\n") == 1
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


@pytest.mark.parametrize("key", ["ϵ_high", "ε_high", "eps_high", "epsilon_high", "ｅｐｓ_high"])
def test_set_keys_are_normalised_as_in_a_file(key):
    proc = drpo_analyze("ppo", "--set", f"{key}=0.3", "--json")
    assert proc.returncode == 0, proc.stderr
    assert '"eps_high": 0.3' in proc.stdout


@pytest.mark.parametrize("pairs", [["delta=1", "δ=2"], ["delta=1", "delta=1"], ["δ=1", "ｄｅｌｔａ=2"]])
def test_a_parameter_set_twice_is_an_error(pairs):
    proc = drpo_analyze("drpo", *[a for p in pairs for a in ("--set", p)])
    assert proc.returncode == 1 and "is set twice" in proc.stderr and "Traceback" not in proc.stderr


def test_the_api_refuses_a_parameter_set_twice_too():
    with pytest.raises(dsl.DslError, match="parameter 'δ' is set twice: δ=0.3 and delta=0.5"):
        dsl.load("drpo", params={"δ": "0.3", "delta": "0.5"})


@pytest.mark.parametrize("value, shown", [("1e-400", "δ = 1e-400"), ("1e300", "π: μ + 1e+300")])
def test_huge_and_tiny_numbers_print_short(value, shown):
    proc = drpo_analyze("drpo", "--set", f"delta={value}")
    text = proc.stdout + proc.stderr
    assert shown in text, text
    assert max(len(w) for w in text.split()) < 40, max(text.split(), key=len)


@pytest.mark.parametrize("module, name", [("openrlhf_drpo.cli", "drpo-analyze"), ("openrlhf_drpo.lab", "drpo-lab"),
                                          ("openrlhf_drpo.hosts.openrlhf.train", "drpo-train")])
def test_each_command_prints_the_projects_version(module, name):
    proc = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{name} {openrlhf_drpo.__version__}")
    assert importlib.metadata.version("openrlhf-drpo") == openrlhf_drpo.__version__     # setup.cfg reads it


def test_list_prints_each_shipped_objective_on_one_line_from_its_header():
    proc = drpo_analyze("--list")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == dsl.shipped_names()
    assert lines[dsl.shipped_names().index("gspo")].split(None, 1)[1] == header("gspo")[0] == \
        "GSPO: Group Sequence Policy Optimization"
    # in a terminal's 100 columns: a longer header ends at a word, with " …"
    assert max(map(len, lines)) <= 100 and max(len(header(n)[0]) for n in dsl.shipped_names()) > 100
    cispo = lines[dsl.shipped_names().index("cispo")].split(None, 1)[1]
    assert cispo.endswith(" …") and header("cispo")[0].startswith(cispo[:-2] + " ")


def test_an_objective_takes_its_own_values_as_name_colon_pairs():
    proc = drpo_analyze("drpo:delta=0.2", "spo:ε=0.1,", "drpo", "--json")
    assert proc.returncode == 0, proc.stderr
    assert [(r["name"], r["params"]) for r in json.loads(proc.stdout)] == \
        [("drpo", {"delta": 0.2}), ("spo", {"eps": 0.1}), ("drpo", {"delta": 12.5})]
    assert drpo_analyze("drpo:delta=0.2").stdout == drpo_analyze("drpo", "--set", "delta=0.2").stdout


def test_objectives_may_follow_options():
    proc = drpo_analyze("drpo", "--set", "delta=0.2", "spo", "--json")
    assert proc.returncode == 0, proc.stderr
    assert [(r["name"], r["params"]) for r in json.loads(proc.stdout)] == [("drpo", {"delta": 0.2}), ("spo", {"eps": 0.2})]


@pytest.mark.parametrize("args, message", [
    (["drpo:delta"], "<command line>:1:6: error: expected NAME=VALUE after 'drpo:', got 'delta'"),
    (["drpo:delta=0.1,delta=0.2"], "<command line>:1:16: error: 'delta' is set twice"),
    (["drpo:delta=0.3", "--set", "delta=0.2"], "--set:1:1: error: 'delta' is set twice: in 'drpo:delta=0.3' and by"),
    (["drpo:foo=1"], "<command line>:1:1: error: unknown parameter 'foo' for objective 'drpo'"),
    ([], "error: name at least one objective (a .dsl file or a shipped name; --list lists them)"),
    (["drpo", "--list"], "error: --list takes no objective and no other option"),
])
def test_a_bad_objective_argument_is_a_located_error(args, message):
    proc = drpo_analyze(*args)
    assert proc.returncode in (1, 2) and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_sweep_prints_one_table_of_boundaries_range_and_warnings_per_value(tmp_path):
    proc = drpo_analyze("drpo", "--sweep", "δ=0.1,0.2,1", "--plot", str(tmp_path / "s.png"))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "drpo: δ swept" and lines[2].split()[:4] == ["value", "w", "range", "boundary"]
    rows = {line.split("  ")[0]: line.split("  ")[1:] for line in lines[4:7]}
    assert list(rows) == ["δ = 0.1", "δ = 0.2", "δ = 1"] and lines[7].split() == ["(unreachable)"]
    assert [c.strip() for c in rows["δ = 0.1"] if c.strip()][:3] == ["[-9, 11]", "μ + 0.1", "μ − 0.1"]
    assert [c.strip() for c in rows["δ = 1"] if c.strip()][:3] == ["[0, 2]", "μ + 1", "none"]
    warned = lines[lines.index("warnings") + 1:-2]
    assert [line[:9] for line in warned if not line.startswith("    ")] == ["  δ = 1: "] * 2
    assert max(map(len, lines)) <= 100
    assert lines[-1] == f"wrote {tmp_path / 's.png'}" and (tmp_path / "s.png").stat().st_size > 10_000
    one = [drpo_analyze(f"drpo:delta={d}", "--json") for d in ("0.1", "1")]
    swept = json.loads(drpo_analyze("drpo", "--sweep", "delta=0.1,1", "--json").stdout)
    assert [s["boundary"] for s in swept] == [json.loads(p.stdout)["boundary"] for p in one]


@pytest.mark.parametrize("args, message", [
    (["drpo", "--sweep", "delta=1"], "write NAME=V1,V2,... with at least two values"),
    (["drpo", "ppo", "--sweep", "delta=1,2"], "--sweep analyses exactly one objective"),
    (["drpo", "--sweep", "foo=1,2"], "--sweep:1:1: error: unknown parameter 'foo' for objective 'drpo'"),
    (["drpo", "--sweep", "delta=1,x"], "--sweep:1:7: error: parameter value 'x' is not a finite number"),
    (["drpo:delta=0.3", "--sweep", "delta=0.1,0.2"], "delta is also set in 'drpo:delta=0.3' or by --set; keep one"),
    (["drpo", "--set", "δ=0.3", "--sweep", "delta=0.1,0.2"], "delta is also set in 'drpo' or by --set; keep one"),
    (["--list", "--set", "delta=1"], "--list takes no objective and no other option"),
])
def test_a_bad_sweep_is_a_clear_error(args, message):
    proc = drpo_analyze(*args)
    assert proc.returncode in (1, 2) and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_compared_panels_share_one_colour_scale(tmp_path):
    from openrlhf_drpo import analyze
    from openrlhf_drpo.analysis.present.plot import plot
    limits = plot([analyze("drpo", delta=0.1), analyze("drpo", delta=1)], str(tmp_path / "w.png"))
    alone = plot([analyze("drpo", delta=1)], str(tmp_path / "one.png"))
    assert len(limits) == 4 and len(set(limits)) == 1 and limits[0] != alone[0]
    assert limits[0][0] < -5 < 5 < limits[0][1] and -1 < alone[0][0] < alone[0][1] < 3


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_the_completion_script_completes_each_commands_flags_choices_and_objectives(shell, tmp_path):
    script = drpo_analyze("--completion", shell)
    assert script.returncode == 0 and script.stderr == "", script.stderr
    (tmp_path / "c.sh").write_text(script.stdout)
    (tmp_path / "mine.dsl").write_text("r*A\n")
    cases = [("drpo-analyze", "dr"), ("drpo-analyze", "--sw"), ("drpo-analyze", "mi"), ("drpo-lab", "--preset", "st"),
             ("drpo-train", "--drpo.anc"), ("drpo-train", "--drpo.anchor", "r"), ("drpo-analyze", "--set", "d"),
             ("drpo-train", "--drpo.objective", "gs"), ("drpo-lab", "--ver")]
    calls = "\n".join(f"COMP_WORDS=({' '.join(c)}); COMP_CWORD={len(c) - 1}; COMPREPLY=(); _drpo_complete; "
                      'echo "${COMPREPLY[*]}"' for c in cases)
    if shell == "zsh":      # (bash runs it: the zsh script is the bash one behind bashcompinit)
        assert script.stdout.startswith("autoload -U +X bashcompinit && bashcompinit\n")
        (tmp_path / "c.sh").write_text(script.stdout.split("\n", 1)[1])
    out = subprocess.run(["bash", "-c", f"source c.sh\n{calls}"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["dro drpo", "--sweep", "mine.dsl", "stress stale", "--drpo.anchor", "rollout",
                                       "", "gspo gspo_seq_mean_is gspo_turn", "--version"]


def test_the_plot_names_the_w_zero_line_in_a_legend_where_a_panel_draws_it(tmp_path, monkeypatch):
    import matplotlib.figure
    from openrlhf_drpo import analyze
    from openrlhf_drpo.analysis.present.plot import plot
    shown, save = [], matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):       # each panel's legend, as the file gets it
        shown.append([[t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else []
                      for ax in fig.axes if ax.get_label() != "<colorbar>"])
        return save(fig, *args, **kwargs)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    # drpo's boundaries are π = μ ± δ: inside the square at δ = 0.1, outside it at δ = 1 (no line drawn)
    plot([analyze("drpo", delta=0.1), analyze("drpo", delta=1)], str(tmp_path / "w.png"))
    boundary = "w = 0 or changes sign (the boundary)"
    assert [boundary in legend for legend in shown[0]] == [True, True, False, False], shown
    assert all("π = μ (r = 1)" in legend for legend in shown[0]), shown


@pytest.mark.parametrize("typed, meant", [("dpro", "drpo"), ("gpso", "gspo"), ("drp", "drpo"), ("grpo_clip_hihger", "grpo_clip_higher")])
def test_a_mistyped_name_gets_the_shipped_name_one_edit_away_a_swap_counting_one(typed, meant):
    proc = drpo_analyze(typed)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == f"{typed}:1:1: error: no objective file or shipped objective named '{typed}'"
    assert lines[1].startswith(f"hint: did you mean '{meant}'? (drpo-analyze --list lists the ") and len(lines[1]) < 100


def test_a_missing_file_is_not_found_with_the_close_dsl_files_beside_it(tmp_path):
    for name in ("dapo_zv.dsl", "dapo_zvw.dsl", "other.dsl", "far_away_name.dsl"):
        (tmp_path / name).write_text("r*A\n")
    proc = drpo_analyze("dapo_zvv.dsl", cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["dapo_zvv.dsl:1:1: error: file not found: 'dapo_zvv.dsl'",
                                        "hint: .dsl files in this directory with a close name: dapo_zv.dsl, dapo_zvw.dsl"]
    proc = drpo_analyze("runs/drpo.dsl", cwd=tmp_path)
    assert proc.stderr.splitlines()[1] == "hint: no such directory: runs"
    proc = drpo_analyze(str(tmp_path / "drop.dsl"))
    assert proc.stderr.splitlines()[1] == (f"hint: no .dsl file in {tmp_path} has a close name (it holds 4); "
                                           "the shipped objective 'drpo' is named by its name alone")


def test_plot_without_matplotlib_is_one_line_naming_the_extra_before_any_analysis(tmp_path):
    """The analyser-only install (`pip install .`), simulated: matplotlib cannot be imported."""
    code = ("import sys\nsys.modules['matplotlib'] = None\nsys.argv = ['drpo-analyze', 'drpo', '--plot', 'x.png']\n"
            "from openrlhf_drpo.cli import main\nsys.exit(main())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "" and not list(tmp_path.iterdir())
    assert proc.stderr == ("drpo-analyze: error: --plot needs matplotlib, which is not installed: pip install '.[plot]' "
                           "(in the repository) adds it\n")
