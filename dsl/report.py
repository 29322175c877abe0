"""Deprecated alias of openrlhf_drpo.analysis.report."""
from openrlhf_drpo.analysis.report import comparison, report, to_json  # noqa: F401
