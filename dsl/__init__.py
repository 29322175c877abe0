"""Deprecated alias, kept for one release: the language is openrlhf_drpo.lang and the analysis
openrlhf_drpo.analysis. `import dsl` still gives the language's API; dsl.parser, dsl.analysis,
dsl.report and dsl.codegen name their new homes' main functions."""
import warnings

from openrlhf_drpo.lang import DslError, Objective, load, parse, parse_bytes, shipped_names

warnings.warn("the dsl package is now openrlhf_drpo.lang (the language) and openrlhf_drpo.analysis; "
              "dsl is an alias kept for one release", DeprecationWarning, stacklevel=2)
__all__ = ["DslError", "Objective", "load", "parse", "parse_bytes", "shipped_names"]
