"""openrlhf-drpo: per-token policy objectives written as mathematics, analysed with SymPy
and compiled to torch losses for OpenRLHF. Torch is imported only when a loss is built."""


def __getattr__(name):
    if name == "ObjectiveLoss":
        from .loss import ObjectiveLoss
        return ObjectiveLoss
    raise AttributeError(name)
