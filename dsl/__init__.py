"""The objective language: parse a .dsl file into one IR (see dsl.ir)."""
from .errors import DslError
from .objective import Objective
from .parser import load, parse, parse_bytes, shipped_names

__all__ = ["DslError", "Objective", "load", "parse", "parse_bytes", "shipped_names"]
