"""The public API is typed (issue 40 item 6): both packages ship py.typed, and every function and
public method that a package's __all__ names annotates each parameter and its result. Read from
the sources (ast), so that the TRL and verl adapters are checked without importing their hosts."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# each module whose __all__ is the public API, and the file that defines each name it lists (a
# package's __init__ re-exports them: followed through its `from X import name` lines)
MODULES = ["dsl/__init__.py", "openrlhf_drpo/analysis/__init__.py", "openrlhf_drpo/core/__init__.py",
           "openrlhf_drpo/hosts/trl.py", "openrlhf_drpo/hosts/verl.py"]


def public_names(path: pathlib.Path) -> list[str]:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__all__"]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path.relative_to(ROOT)} declares no __all__")


def definition(path: pathlib.Path, name: str):
    """The def or class `name` in path, or in the module path imports it from (None: not a def)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return path, node
        bound = {a.asname or a.name: a.name for a in getattr(node, "names", ())}
        if isinstance(node, ast.ImportFrom) and name in bound and node.module:
            module = ROOT / node.module.replace(".", "/")
            return definition(module / "__init__.py" if module.is_dir() else module.with_suffix(".py"), bound[name])
    return None


def unannotated(fn, where: str) -> list[str]:
    args = fn.args
    params = [p for p in (*args.posonlyargs, *args.args, *args.kwonlyargs) if p.arg not in ("self", "cls")]
    out = [f"{where}({p.arg})" for p in params if p.annotation is None]
    return out + ([f"{where} -> ?"] if fn.returns is None and fn.name != "__init__" else [])


def api_gaps(module: str) -> list[str]:
    gaps = []
    for name in public_names(ROOT / module):
        found = definition(ROOT / module, name)
        if found is None:
            continue        # a constant
        path, node = found
        where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        if isinstance(node, ast.FunctionDef):
            gaps += unannotated(node, where)
            continue
        for m in node.body:          # a class: its own public methods and its constructor
            if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and (m.name == "__init__" or not m.name.startswith("_")):
                gaps += unannotated(m, f"{where}.{m.name}")
    return gaps


@pytest.mark.parametrize("module", MODULES)
def test_every_function_and_method_of_the_public_api_annotates_its_parameters_and_result(module):
    assert not api_gaps(module)


def test_objective_loss_annotates_its_parameters_and_result():
    path = ROOT / "openrlhf_drpo/hosts/openrlhf/loss.py"
    (node,) = [n for n in ast.parse(path.read_text(encoding="utf-8")).body
               if isinstance(n, ast.ClassDef) and n.name == "ObjectiveLoss"]
    assert not [g for m in node.body if isinstance(m, ast.FunctionDef) and not m.name.startswith("_")
                for g in unannotated(m, m.name)]


def test_the_gap_check_finds_a_missing_annotation_through_a_re_export(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('from pkg.mod import f, C\n__all__ = ["f", "C", "K"]\nK = 1\n')
    (tmp_path / "pkg" / "mod.py").write_text("def f(x: int, y=2) -> int: ...\nclass C:\n"
                                             "    def __init__(self, a: int): ...\n    def go(self, b: str): ...\n"
                                             "    def _private(self, c): ...\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert api_gaps("pkg/__init__.py") == ["pkg/mod.py:1 f(y)", "pkg/mod.py:2 C.go -> ?"]


@pytest.mark.parametrize("package", ["dsl", "openrlhf_drpo"])
def test_each_package_ships_py_typed(package):
    assert (ROOT / package / "py.typed").is_file()
    setup = (ROOT / "setup.cfg").read_text(encoding="utf-8")
    assert any(line.startswith(f"{package} = ") and "py.typed" in line for line in setup.splitlines()), setup
