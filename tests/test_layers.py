"""The two packages read top-down: every import inside dsl and openrlhf_drpo, at module level or
inside a function, goes to a module below the importer in LAYERS (so there is no cycle and
nothing runs back up: the language knows no loss or analysis, the core no host, no host the
lab), no private name is imported from another module, and no source file or class outgrows a
reading."""
import ast
import subprocess
import sys
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("dsl", "openrlhf_drpo")
# bottom first: the language (the package dsl, which imports nothing above it), the torch code
# generated from it and the loss core, the analysis (its engine, the typed result, its entry
# point and presentation), the hosts, the lab, the command line
LAYERS = [
    "dsl.errors", "dsl.names", "dsl.ir", "dsl.lowerings", "dsl.adjoints", "dsl.uniform", "dsl.operations", "dsl.levels",
    "dsl.walks", "dsl.printing", "dsl.source", "dsl.vocabulary", "dsl.controls", "dsl.objective", "dsl.expressions", "dsl.library", "dsl.parser",
    "dsl",
    "core.values", "core.rewrites", "core.reverse_mode", "core.kernel_table", "core.codegen", "core.boundary", "core.collectives",
    "core.reductions", "core.kernels", "core.batch", "core.controls", "core.hosting",
    "core.measures", "core.loss",
    "core",
    "analysis.budgets", "analysis.mathtext", "analysis.symbolic.context", "analysis.batch.held", "analysis.batch.view", "analysis.numeric.arbiter",
    "analysis.numeric.extremes", "analysis.numeric.events", "analysis.numeric.sampling", "analysis.symbolic.intervals", "analysis.symbolic.cells",
    "analysis.symbolic.settling", "analysis.symbolic.zeros", "analysis.symbolic.derivation", "analysis.symbolic.channels", "analysis.symbolic.confirm",
    "analysis.alerts", "analysis.present.alert_text", "analysis.batch.advantage",
    "analysis.claims", "analysis.admissibility", "analysis.batch.scenario_check", "analysis.batch.scenarios", "analysis.equiv",
    "analysis.result", "analysis.memory", "analysis.orchestrator", "analysis.present.first_lines", "analysis.present.scenario_text", "analysis.present.memory_text",
    "analysis.present.summary", "analysis.present.report", "analysis.present.comparison", "analysis.present.plot", "analysis.present.equiv_report", "analysis.present.notebook",
    "analysis.numeric", "analysis.symbolic", "analysis.batch", "analysis.present", "analysis",
    "hosts", "hosts.openrlhf.vllm_worker", "hosts.openrlhf.cpu_mode", "hosts.openrlhf.options", "hosts.openrlhf.reward",
    "hosts.openrlhf.logprobs", "hosts.openrlhf.support", "hosts.openrlhf.inputs", "hosts.openrlhf.controls", "hosts.openrlhf.loss",
    "hosts.openrlhf.actor", "hosts.openrlhf.versions", "hosts.openrlhf.launch", "hosts.openrlhf.train", "hosts.openrlhf", "hosts.trl_config", "hosts.trl",
    "hosts.verl",
    "lab.toytask", "lab.task", "lab.pipe", "lab.results", "lab.plots", "lab.driver", "lab", "lab.__main__",
    "completion", "cli", "trl", "verl", "openrlhf_drpo",
]


def module_name(path: pathlib.Path) -> str:
    """dsl.parser, dsl, analysis.present.report (openrlhf_drpo's modules are named inside it), openrlhf_drpo."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts[1:] if parts[0] == "openrlhf_drpo" and len(parts) > 1 else parts)


SOURCES = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
MODULES = sorted(module_name(p) for p in SOURCES)


def module_path(name):
    top = name.split(".")[0]
    path = ROOT.joinpath(*name.split(".")) if top in PACKAGES else ROOT.joinpath("openrlhf_drpo", *name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def local(module):
    """The LAYERS name of an imported module of either package, or None for anything else."""
    if module == "openrlhf_drpo" or module == "dsl" or module.startswith("dsl."):
        return module
    return module[len("openrlhf_drpo."):] if module.startswith("openrlhf_drpo.") else None


def imports(name):
    """(line, module imported, name imported or None) for every import of a dsl or openrlhf_drpo module."""
    path = module_path(name)
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: a relative import (these packages import by full name)")
        if isinstance(node, ast.ImportFrom) and local(node.module or "") is not None:
            module = local(node.module)
            for a in node.names:     # `from openrlhf_drpo.lab import pipe` imports the module lab.pipe
                sub = f"{module}.{a.name}" if module != "openrlhf_drpo" else a.name
                out.append((node.lineno, sub, None) if sub in MODULES else (node.lineno, module, a.name))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, local(a.name), None) for a in node.names if local(a.name) is not None]
    return path, out


def test_every_module_has_its_place_in_the_layers():
    assert sorted(LAYERS) == MODULES


@pytest.mark.parametrize("name", MODULES)
def test_a_module_imports_only_from_below_it_and_no_private_name(name):
    rank = LAYERS.index(name)
    path, found = imports(name)
    for line, module, imported in found:
        if (module, imported) == ("openrlhf_drpo", "__version__"):
            continue      # the package's metadata: its __init__ runs before any of its modules anyway
        assert LAYERS.index(module) < rank, f"{path}:{line} imports {module}, which is not below it"
        assert not (imported or "").startswith("_"), f"{path}:{line} imports the private {module}.{imported}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_source_file_or_class_outgrows_a_reading(path):
    text = path.read_text(encoding="utf-8")
    assert text.count("\n") <= 400, f"{path} has {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno < 120, f"{path}: class {node.name} has " \
                f"{node.end_lineno - node.lineno + 1} lines"


def test_the_language_package_runs_with_nothing_of_openrlhf_drpo():
    code = ("import sys, dsl, dsl.parser, dsl.walks, dsl.library\n"
            "dsl.load('otb')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('openrlhf_drpo', 'objectives')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout == "[]\n", out.stdout


def _docstrings(tree):
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


@pytest.mark.parametrize("path", sorted((ROOT / "dsl").rglob("*.py")), ids=lambda p: p.name)
def test_the_language_package_holds_no_torch_code(path):
    """dsl/ imports no torch and holds none as text to execute (the reductions' functions are
    core.reductions' real code, seen by linters and coverage): a row's torch lowering is one line."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        assert not any(name.split(".")[0] == "torch" for name in names), f"{path}:{node.lineno} imports torch"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            assert not ("torch" in node.value and "\n" in node.value), f"{path}:{node.lineno}: torch code in a string"
