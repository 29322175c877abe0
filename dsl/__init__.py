"""The objective language: parse a .dsl file into one IR (see dsl.ir)."""
from dsl.errors import DslError
from dsl.objective import Objective
from dsl.parser import load, parse, parse_bytes, parse_spec, shipped_names

__all__ = ["DslError", "Objective", "load", "parse", "parse_bytes", "parse_spec", "shipped_names"]
