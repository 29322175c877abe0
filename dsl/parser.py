"""Deprecated alias of openrlhf_drpo.lang.parser (and the Objective it used to hold)."""
from openrlhf_drpo.lang.objective import OPTIONS, Objective, param_key  # noqa: F401
from openrlhf_drpo.lang.parser import library, load, parse, parse_bytes, shipped_names  # noqa: F401
