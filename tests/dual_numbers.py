"""Dual numbers over numpy float64 for the differential test's reference (tests/reference_dual.py):
a value array and its gradient with respect to every input element, in forward mode."""
from __future__ import annotations

import numpy as np

NEAR = 1e-9             # a comparison closer than this (relative) but not equal is decided by rounding


class NoSemantics(Exception):
    """The reference has no meaning for an operation: the test fails, naming it."""


class Dual:
    """A value array and its gradient, the same shape plus one axis over every input element."""
    __slots__ = ("v", "g")

    def __init__(self, v, g):
        self.v, self.g = v, g


def scaled(p, g):
    """p·g over the tangent axis, where a zero tangent stays 0 whatever p is: an input a value does
    not depend on gets no NaN from a non-finite partial (as reverse mode never visits it)."""
    return np.where(g == 0, 0.0, np.asarray(p)[..., None] * g)
