"""Deprecated alias, kept for one release: the shipped objectives are openrlhf_drpo/objectives/
(this module is openrlhf_drpo.objectives itself)."""
import sys

from openrlhf_drpo import objectives as _library

sys.modules[__name__] = _library
