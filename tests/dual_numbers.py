"""Dual numbers over numpy float64 for the differential test's reference (tests/reference_dual.py):
a value array and its gradient with respect to every input element, in forward mode."""
from __future__ import annotations

import numpy as np

NEAR = 1e-9             # a comparison closer than this (relative) but not equal is decided by rounding


class NoSemantics(Exception):
    """The reference has no meaning for an operation: the test fails, naming it."""


class Dual:
    """A value array, its gradient (the same shape plus one axis over every input element) and where
    it depends on each input at all (`d`, bool, as g): a structural zero, which a selection (a mask, an
    indicator, a branch of min/max/clip, the ratio's clamp where active) or an input that never reaches
    the value leaves, as against a gradient that is 0 by arithmetic."""
    __slots__ = ("v", "g", "d")

    def __init__(self, v, g, d):
        self.v, self.g, self.d = v, g, d


def scaled(p, g, d):
    """p·g over the tangent axis where the value depends on the input (IEEE there: inf·0 is NaN, as
    the chain rule in any mode gives it), 0 where it does not, whatever p is (reverse mode never visits
    an input a value does not reach)."""
    return np.where(d, np.asarray(p)[..., None] * g, 0.0)
