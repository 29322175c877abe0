"""Import stand-in for flash_attn (tests on machines without it)."""
