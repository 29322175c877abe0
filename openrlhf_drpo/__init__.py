"""openrlhf-drpo: per-token policy objectives written as mathematics, analysed with SymPy
and compiled to torch losses for OpenRLHF. Torch is imported only when a loss is built, so
drpo-analyze runs on an install without it (`pip install .`)."""
import importlib

__version__ = "0.1.0"     # setup.cfg reads it; --version prints it

_LOSSES = {"CompiledLoss": ".core", "Aggregation": ".core", "ObjectiveLoss": ".hosts.openrlhf.loss"}


def __getattr__(name):
    if name == "analyze":     # the analysis alone: no torch
        return importlib.import_module(".analysis", __name__).analyze
    if name not in _LOSSES:
        raise AttributeError(name)
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        # torch is the `loss` extra: the analysis alone installs without it (setup.cfg)
        raise ModuleNotFoundError(
            f"{name} needs torch, which is not installed (drpo-analyze needs none): "
            "pip install '.[loss]' in the repository adds it; bash scripts/setup.sh installs everything",
            name="torch") from None
    return getattr(importlib.import_module(_LOSSES[name], __name__), name)
