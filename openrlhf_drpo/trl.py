"""The public path of the TRL adapter, openrlhf_drpo.hosts.trl (this module is that one)."""
import sys

from openrlhf_drpo.hosts import trl as _adapter

sys.modules[__name__] = _adapter
