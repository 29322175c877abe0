"""Adversarial batches for the differential test, seeded, as numpy float64 arrays (the reference's
input; tests/differential.py turns them into the loss's tensors): 1 to 5 responses of unequal
lengths, empty ones, holes inside a response, groups of one and groups with an empty response (ids
any integers), turns (contiguous, interleaved, split by a hole), exact ties (values on a grid of
eighths, equal responses in a group, π = μ), log-ratios beyond ±20, NaN and ±inf in every masked
slot of every input, and the inputs beyond log π, μ and A: π_ref, H ≥ 0, Σπ² ≥ π², staleness, and a
top-k support (k = 3) of a distribution over k + 2 entries, sorted as a top-k is; sometimes a
host's normalizer (0 where the step has no token) and per-token weights."""
from __future__ import annotations

import numpy as np

K = 3
FLOATS = ("logp", "old", "rollout", "A", "ref", "H", "sum_pi_sq", "staleness")


def _grid(rng, shape, lo, hi):
    return rng.integers(lo, hi + 1, size=shape) / 8.0


def batch(rng: np.random.Generator) -> dict:
    B, T = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    ties = rng.random() < 0.5
    mask = rng.random((B, T)) < rng.choice([1.0, 0.8, 0.6])
    for b in range(B):
        if rng.random() < 0.2:
            mask[b] = False                                  # an empty response
    if rng.random() < 0.04:
        mask[:] = False                                      # a step with no token
    if ties:
        logp = -_grid(rng, (B, T), 1, 16)
        old = logp + _grid(rng, (B, T), -2, 2)
        rollout = old + _grid(rng, (B, T), -1, 1)
        A = _grid(rng, (B, 1), -12, 12) * np.ones((1, T))
        H = _grid(rng, (B, T), 0, 12)
        if B > 1 and rng.random() < 0.5:                     # equal responses in a group
            for x in (logp, old, rollout, A, H):
                x[1] = x[0]
            mask[1] = mask[0]
    else:
        logp = -rng.random((B, T)) * 3 - 0.01
        old = logp + 0.3 * rng.standard_normal((B, T))
        rollout = old + 0.1 * rng.standard_normal((B, T))
        A = rng.standard_normal((B, 1)) * np.ones((1, T)) if rng.random() < 0.6 else rng.standard_normal((B, T))
        H = rng.random((B, T)) * 2
    if rng.random() < 0.3:                                   # log-ratios beyond ±20
        far = rng.random((B, T)) < 0.3
        old = np.where(far, logp + rng.choice([-25.0, 25.0], size=(B, T)), old)
        rollout = np.where(far, logp + rng.choice([-30.0, 22.0], size=(B, T)), rollout)
    pi = np.exp(logp)
    groups = rng.integers(0, int(rng.integers(1, B + 1)), size=B) * 3 + 7
    turns = _turns(rng, mask)
    z = 2 * rng.standard_normal((B, T, K + 2))
    z = -np.sort(-z, axis=-1)                               # the top-k first, as a top-k support
    logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
    zr = z + 0.5 * rng.standard_normal(z.shape)
    logr = zr - np.log(np.exp(zr).sum(-1, keepdims=True))
    out = {"mask": mask, "logp": logp, "old": old, "rollout": rollout, "A": A,
           "ref": logp + 0.4 * (rng.random((B, T)) - 0.5), "H": H,
           "sum_pi_sq": pi ** 2 + rng.random((B, T)) * (1 - pi) ** 2,
           "staleness": rng.integers(0, 4, size=(B, T)).astype(float), "groups": groups, "turns": turns,
           "vocab_logp": logq[..., :K], "vocab_ref": logr[..., :K], "mode": None,
           "norm": None, "weights": None}
    if rng.random() < 0.3:
        out["norm"] = 0.0 if not mask.any() and rng.random() < 0.5 else float(mask.sum() + 1.5)
    if rng.random() < 0.2:
        out["weights"] = rng.random((B, T)) + 0.5
    return dirty(out)


def _turns(rng, mask):
    B, T = mask.shape
    how = rng.integers(3)
    if how == 0:         # contiguous turns of 1 to 3 tokens
        return np.arange(T)[None, :].repeat(B, 0) // int(rng.integers(1, 4))
    if how == 1:         # any ids, a turn not contiguous
        return rng.integers(0, 3, size=(B, T)) * 5 - 2
    starts = np.zeros((B, T), dtype=np.int64)               # a new turn after each hole
    starts[:, 1:] = ~mask[:, 1:] & mask[:, :-1]
    return starts.cumsum(-1)


def dirty(b: dict) -> dict:
    """NaN, +inf and −inf (in turn) in every masked slot of every per-token input and of the support."""
    mask = b["mask"]
    out = dict(b)
    for name in FLOATS + ("vocab_logp", "vocab_ref"):
        x = b[name].copy()
        junk = np.resize(np.array([np.nan, np.inf, -np.inf]), x.shape)
        where = mask if x.ndim == 2 else mask[..., None].repeat(x.shape[-1], -1)
        out[name] = np.where(where, x, junk)
    return out


def given(logp, old, A=0.0, mask=None, **more) -> dict:
    """A batch written by hand (an issue's case): log π, log μ (π_old, also π_rollout), A, the mask and any
    other input; the rest filled with harmless values (H = 1, Σπ² = π², one group, one turn, staleness 0)."""
    logp = np.asarray(logp, dtype=float)
    B, T = logp.shape
    full = lambda x: np.broadcast_to(np.asarray(x, dtype=float), (B, T)).copy()    # noqa: E731
    z = np.log(np.full((B, T, K), 1.0 / (K + 1)))
    out = {"mask": np.ones((B, T), dtype=bool) if mask is None else np.asarray(mask, dtype=bool), "logp": logp,
           "old": full(old), "rollout": full(old), "A": full(A), "ref": logp.copy(), "H": full(1.0),
           "sum_pi_sq": np.exp(2 * logp), "staleness": full(0.0), "groups": np.zeros(B, dtype=np.int64),
           "turns": np.zeros((B, T), dtype=np.int64), "vocab_logp": z, "vocab_ref": z.copy(), "mode": None,
           "norm": None, "weights": None}
    for k, v in more.items():
        out[k] = v if k in ("norm", "mode") else np.asarray(v, dtype=out[k].dtype if k in out and
                                                              isinstance(out[k], np.ndarray) else float)
    return out
