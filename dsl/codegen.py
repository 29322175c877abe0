"""Deprecated alias of openrlhf_drpo.core.codegen."""
from openrlhf_drpo.core.codegen import compile_objective, torch_source  # noqa: F401
