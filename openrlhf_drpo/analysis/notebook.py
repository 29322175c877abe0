"""The analysis as a value in a notebook: the report with its plot as markdown or HTML, and the
JSON, registered on the result (analysis.result.RENDER) so that it knows no presentation."""
from __future__ import annotations

import base64
import html
import io

from openrlhf_drpo.analysis import result
from openrlhf_drpo.analysis.report import report, to_json


def plot_png(res) -> str | None:
    """The --plot picture as base64 PNG, or None without matplotlib (the `plot` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        return None
    from openrlhf_drpo.analysis.plot import plot
    buffer = io.BytesIO()
    plot([res], buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def markdown(res) -> str:
    png = plot_png(res)
    return f"```text\n{report(res)}\n```\n" + (f"\n![w over (μ, π)](data:image/png;base64,{png})\n" if png else "")


def html_page(res) -> str:
    png = plot_png(res)
    return (f"<pre>{html.escape(report(res))}</pre>"
            + (f'<img alt="w over (μ, π)" src="data:image/png;base64,{png}"/>' if png else ""))


result.RENDER.update(json=to_json, markdown=markdown, html=html_page)
