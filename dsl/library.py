"""The library of shipped objectives: `drpo` names objectives/drpo.dsl."""
import os
import pathlib


def folder() -> pathlib.Path:
    """objectives/ beside this package in a checkout (an editable install too); a wheel installs it
    as dsl/objectives (setup.cfg's package_dir). Found by path, never by import, so that no folder
    named objectives on sys.path, the current directory included, can stand in for it."""
    here = pathlib.Path(__file__).resolve().parent
    return here / "objectives" if (here / "objectives").is_dir() else here.parent / "objectives"


def shown(path: pathlib.Path) -> str:
    """The path a report or an error prints for a shipped file: relative to the working directory
    when it lies below it (objectives/drpo.dsl in a checkout), else absolute, so that it exists."""
    rel = os.path.relpath(path, pathlib.Path.cwd().resolve())
    return str(path) if rel.startswith("..") else rel
_ABBREVIATIONS = ("Alg", "Eq", "Eqs", "al", "e.g", "i.e", "vs", "§")


def first_sentence(text: str) -> str:
    """Up to the first '. ' or '; ' outside brackets that does not follow an abbreviation."""
    depth = 0
    for i, c in enumerate(text):
        depth += (c in "([") - (c in ")]")
        if depth == 0 and c in ".;" and text[i + 1:i + 2] in (" ", ""):
            if c == ";" or not text[:i].endswith(_ABBREVIATIONS):
                return text[:i]
    return text.rstrip(".")


def header(name: str) -> tuple[str, str]:
    """(what it is, its source) from a shipped file's leading comment: the comment's first
    sentence, and the first sentence after `Source:`."""
    comment = []
    for line in (folder() / f"{name}.dsl").read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        comment.append(line[1:].strip())
    body, _, source = " ".join(comment).partition("Source:")
    return first_sentence(body.strip()), first_sentence(source.strip())


def library_table() -> str:
    """The library as a markdown table, from the files' own headers (docs/library.md holds it,
    and a test keeps the two equal)."""
    cell = lambda s: s.replace("|", "\\|")     # noqa: E731  (|π − μ| in a cell)
    rows = ["| name | what it is | source |", "| --- | --- | --- |"]
    for path in sorted(folder().glob("*.dsl")):
        what, source = header(path.stem)
        rows.append(f"| `{path.stem}` | {cell(what)} | {cell(source)} |")
    return "\n".join(rows) + "\n"
