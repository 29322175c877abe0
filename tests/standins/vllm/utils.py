def random_uuid() -> str:
    raise RuntimeError("vllm is not installed: this is the tests' import stand-in")
