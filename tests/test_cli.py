"""drpo-analyze's command line at its edges: every bad argument is a clear message and a
non-zero exit, never a traceback; overrides mean the same here as in a file, the API and
drpo-train; numbers print at a readable length."""
import subprocess
import sys

import pytest

import dsl


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
