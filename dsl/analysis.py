"""Deprecated alias: dsl.analysis.analyze is openrlhf_drpo.analysis.orchestrator.analyze."""
from openrlhf_drpo.analysis.orchestrator import analyze  # noqa: F401
from openrlhf_drpo.analysis.report import to_json  # noqa: F401
from openrlhf_drpo.analysis.view import analysis_view  # noqa: F401
