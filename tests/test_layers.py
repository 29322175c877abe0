"""The package reads top-down: every import, at module level or inside a function, goes to a
module below the importer in LAYERS (so there is no cycle), no private name is imported from
another module, and no source file or class outgrows a reading."""
import ast
import pathlib

import pytest

DSL = pathlib.Path(__file__).resolve().parent.parent / "dsl"
# bottom first: the language, the torch code generated from it, then the analysis (its engine,
# the typed result, its entry point and presentation)
LAYERS = [
    "errors", "names", "ir", "lowerings", "operations", "walks", "printing", "source", "objective", "expressions",
    "parser",
    "rewrites", "reverse_mode", "codegen",
    "budgets", "mathtext", "context", "view", "arbiter", "extremes", "events", "sampling", "intervals", "settling",
    "zeros", "symbolic", "confirm", "alerts", "alert_text", "claims", "admissibility", "equiv", "result",
    "analysis", "report", "plot", "equiv_report",
]
MODULES = sorted(p.stem for p in DSL.glob("*.py") if p.stem != "__init__")


def imports(name):
    """(line, module imported, name imported or None) for every import of a dsl module."""
    out = []
    for node in ast.walk(ast.parse((DSL / f"{name}.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out += [(node.lineno, node.module.split(".")[0], a.name) if node.module else (node.lineno, a.name, None)
                    for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsl."):
            out += [(node.lineno, node.module.split(".")[1], a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[1], None) for a in node.names if a.name.startswith("dsl.")]
    return out


def test_every_module_has_its_place_in_the_layers():
    assert sorted(LAYERS) == MODULES


@pytest.mark.parametrize("name", MODULES)
def test_a_module_imports_only_from_below_it_and_no_private_name(name):
    rank = LAYERS.index(name)
    for line, module, imported in imports(name):
        assert LAYERS.index(module) < rank, f"dsl/{name}.py:{line} imports dsl.{module}, which is not below it"
        assert not (imported or "").startswith("_"), f"dsl/{name}.py:{line} imports the private {module}.{imported}"


@pytest.mark.parametrize("name", MODULES)
def test_no_source_file_or_class_outgrows_a_reading(name):
    text = (DSL / f"{name}.py").read_text(encoding="utf-8")
    assert text.count("\n") <= 400, f"dsl/{name}.py has {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno < 120, f"dsl/{name}.py: class {node.name} has " \
                f"{node.end_lineno - node.lineno + 1} lines"
