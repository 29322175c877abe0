"""The library of shipped objectives, as package data: `drpo` names objectives/drpo.dsl."""
import pathlib

HERE = pathlib.Path(__file__).parent
_ABBREVIATIONS = ("Alg", "Eq", "Eqs", "al", "e.g", "i.e", "vs", "§")


def _first_sentence(text: str) -> str:
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
    for line in (HERE / f"{name}.dsl").read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        comment.append(line[1:].strip())
    body, _, source = " ".join(comment).partition("Source:")
    return _first_sentence(body.strip()), _first_sentence(source.strip())


def library_table() -> str:
    """The library as a markdown table, from the files' own headers (docs/library.md holds it,
    and a test keeps the two equal)."""
    cell = lambda s: s.replace("|", "\\|")     # noqa: E731  (|π − μ| in a cell)
    rows = ["| name | what it is | source |", "| --- | --- | --- |"]
    for path in sorted(HERE.glob("*.dsl")):
        what, source = header(path.stem)
        rows.append(f"| `{path.stem}` | {cell(what)} | {cell(source)} |")
    return "\n".join(rows) + "\n"
