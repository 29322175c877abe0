"""The package reads top-down: every import inside openrlhf_drpo, at module level or inside a
function, goes to a module below the importer in LAYERS (so there is no cycle and nothing runs
back up: the language knows no analysis, the core no host, no host the lab), no private name is
imported from another module, and no source file or class outgrows a reading."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "openrlhf_drpo"
# bottom first: the language, the torch code generated from it and the loss core, the analysis
# (its engine, the typed result, its entry point and presentation), the shipped library, the
# hosts, the lab, the command line
LAYERS = [
    "lang.errors", "lang.names", "lang.ir", "lang.lowerings", "lang.adjoints", "lang.operations", "lang.levels",
    "lang.walks", "lang.printing", "lang.source", "lang.objective", "lang.expressions", "lang.parser", "lang",
    "core.rewrites", "core.reverse_mode", "core.codegen", "core.values", "core.boundary", "core.collectives",
    "core.kernels",
    "core.measures", "core.loss",
    "core",
    "analysis.budgets", "analysis.mathtext", "analysis.context", "analysis.held", "analysis.view", "analysis.arbiter",
    "analysis.extremes", "analysis.events", "analysis.sampling", "analysis.intervals", "analysis.cells",
    "analysis.settling", "analysis.zeros", "analysis.symbolic", "analysis.channels", "analysis.confirm",
    "analysis.alerts", "analysis.alert_text",
    "analysis.claims", "analysis.admissibility", "analysis.equiv", "analysis.result", "analysis.orchestrator",
    "analysis.report", "analysis.plot", "analysis.equiv_report", "analysis",
    "objectives",
    "hosts", "hosts.openrlhf.cpu_mode", "hosts.openrlhf.options", "hosts.openrlhf.reward", "hosts.openrlhf.loss",
    "hosts.openrlhf.logprobs", "hosts.openrlhf.inputs",
    "hosts.openrlhf.actor", "hosts.openrlhf.launch", "hosts.openrlhf.train", "hosts.openrlhf", "hosts.trl",
    "hosts.verl",
    "lab.toytask", "lab.task", "lab.pipe", "lab.results", "lab.driver", "lab", "lab.__main__",
    "cli", "trl", "verl", "",
]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(module_name(p) for p in PACKAGE.rglob("*.py"))


def imports(name):
    """(line, module imported, name imported or None) for every import of an openrlhf_drpo module."""
    path = PACKAGE.joinpath(*name.split(".")) if name else PACKAGE
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: a relative import (this package imports by full name)")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("openrlhf_drpo"):
            module = node.module[len("openrlhf_drpo."):] if node.module != "openrlhf_drpo" else ""
            for a in node.names:     # `from openrlhf_drpo.lab import pipe` imports the module lab.pipe
                sub = f"{module}.{a.name}" if module else a.name
                out.append((node.lineno, sub, None) if sub in MODULES else (node.lineno, module, a.name))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name[len("openrlhf_drpo."):], None) for a in node.names
                    if a.name.startswith("openrlhf_drpo.")]
    return path, out


def test_every_module_has_its_place_in_the_layers():
    assert sorted(LAYERS) == MODULES


@pytest.mark.parametrize("name", MODULES)
def test_a_module_imports_only_from_below_it_and_no_private_name(name):
    rank = LAYERS.index(name)
    path, found = imports(name)
    for line, module, imported in found:
        assert LAYERS.index(module) < rank, f"{path}:{line} imports openrlhf_drpo.{module}, which is not below it"
        assert not (imported or "").startswith("_"), f"{path}:{line} imports the private {module}.{imported}"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_source_file_or_class_outgrows_a_reading(path):
    text = path.read_text(encoding="utf-8")
    assert text.count("\n") <= 400, f"{path} has {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno < 120, f"{path}: class {node.name} has " \
                f"{node.end_lineno - node.lineno + 1} lines"
