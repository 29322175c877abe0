"""Import stand-in for vllm (tests on machines without it): names OpenRLHF imports at module level."""


class SamplingParams:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("vllm is not installed: this is the tests' import stand-in")
