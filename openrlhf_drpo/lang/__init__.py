"""The objective language: parse a .dsl file into one IR (see lang.ir)."""
from openrlhf_drpo.lang.errors import DslError
from openrlhf_drpo.lang.objective import Objective
from openrlhf_drpo.lang.parser import load, parse, parse_bytes, shipped_names

__all__ = ["DslError", "Objective", "load", "parse", "parse_bytes", "shipped_names"]
