"""The analysis as a value in a notebook: the report with its plot as markdown or HTML, the text
report and the JSON, registered on the result (analysis.result.RENDER) so that it knows no
presentation. The notebook's plot is a small SVG (the grid's own pixels, text as text: tens of KB
where the --plot PNG is ~250 KB in base64), and its report names the objective's file relative to
the working directory, or a shipped one by its name: no machine's absolute path."""
from __future__ import annotations

import base64
import copy
import html
import io
import os
import pathlib

from dsl import library
from openrlhf_drpo.analysis import result
from openrlhf_drpo.analysis.present.report import report, to_json

POINTS = 120     # the notebook plot's grid per axis (--plot's is 300)


def plot_svg(res) -> str | None:
    """The --plot picture as SVG text (no XML prologue), or None without matplotlib (the `plot` extra)."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return None
    from openrlhf_drpo.analysis.present.plot import plot
    buffer = io.BytesIO()
    # text as text, not glyph outlines; ids hashed from a fixed salt, so the same result draws the same SVG
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "openrlhf-drpo"}):
        plot([res], buffer, fmt="svg", points=POINTS, dpi=72, interpolation="none")
    text = buffer.getvalue().decode("utf-8")
    return text[text.index("<svg"):]


def shown_path(path: str) -> str:
    """A shipped objective by its name (`drpo (shipped)`), another file relative to the working
    directory; a name that is no file (a parsed string's) as it is."""
    if not path or not os.path.isfile(path):
        return path
    resolved = pathlib.Path(path).resolve()
    if resolved.parent == library.folder().resolve():
        return f"{resolved.stem} (shipped)"
    return os.path.relpath(resolved, pathlib.Path.cwd().resolve()) if os.path.isabs(path) else path


def _shown(res):
    """The result with its path as shown_path gives it (a copy: the result itself keeps its path)."""
    out = copy.copy(res)
    out.path = shown_path(res.path)
    return out


def markdown(res) -> str:
    svg = plot_svg(res)
    image = f"\n![w over (μ, π)](data:image/svg+xml;base64,{base64.b64encode(svg.encode()).decode('ascii')})\n"
    return f"```text\n{report(_shown(res))}\n```\n" + (image if svg else "")


def html_page(res) -> str:
    svg = plot_svg(res)
    return f"<pre>{html.escape(report(_shown(res)))}</pre>" + (f'<div title="w over (μ, π)">{svg}</div>' if svg else "")


result.RENDER.update(json=to_json, markdown=markdown, html=html_page, text=report)
