"""The public path of the verl adapter, openrlhf_drpo.hosts.verl (this module is that one):
VERL_USE_EXTERNAL_MODULES=openrlhf_drpo.verl imports it, which registers the objectives."""
import sys

from openrlhf_drpo.hosts import verl as _adapter

sys.modules[__name__] = _adapter
