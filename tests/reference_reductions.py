"""The reference's reductions (tests/reference_dual.py), from docs/language.md alone: what each reads at
a token (its response's, its prefix's, its turn's unmasked tokens; its group's at the same position or
each non-empty response of its group once; the batch's), the value of each kind over those elements
(0 over none) and how its gradient goes back (a mean's 1/n, ties sharing a maximum's, a quantile's two
neighbours by the interpolation weights, each shared by its ties, the sample standard deviation 0
below two elements or where all are equal), and each value's level, which decides what a group or
batch reduction reads. Written as the Reference's methods (`Reductions`, its base class)."""
from __future__ import annotations

import math

import numpy as np

from dual_numbers import NEAR, Dual, NoSemantics, scaled

# each reduction: what it reads ('response', 'prefix', 'turn', 'group', 'batch', 'vocab') and its kind
REDUCTIONS = {**{f"seq_{k}": ("response", k) for k in ("sum", "mean", "max", "min", "quantile")},
              **{f"prefix_{k}": ("prefix", k) for k in ("sum", "mean")},
              **{f"turn_{k}": ("turn", k) for k in ("sum", "mean")},
              **{f"group_{k}": ("group", k) for k in ("sum", "mean", "std", "count", "max", "min")},
              **{f"batch_{k}": ("batch", k) for k in ("sum", "mean", "count", "quantile")},
              "ref_topk_sum": ("vocab", "sum"), "topk_sum": ("vocab", "sum")}
LEVELS = ("constant", "batch", "response", "token", "entry")


def levels(root) -> dict:
    """Each node's level by the language's rules: a number or parameter is a constant; seq_len and a
    seq_* reduction one value per response, a batch reduction one for the batch; a group reduction
    is its argument's level where that is a response's (or wider), else a token's; prefix, turn and
    vocabulary reductions and every other built-in (A included) a token's; π_v, π_ref_v an entry's."""
    out = {}

    def visit(n):
        if n in out:
            return out[n]
        if n.op in ("num", "param"):
            lv = "constant"
        elif n.op == "var":
            lv = "response" if n.value == "seq_len" else "entry" if n.value in ("pi_v", "pi_ref_v") else "token"
        else:
            args = [visit(a) for a in n.args]
            over = REDUCTIONS.get(n.op, (None,))[0]
            if over == "response":
                lv = "response"
            elif over == "batch":
                lv = "batch"
            elif over == "group":
                lv = "token" if args[0] == "token" else "response"
            elif over in ("prefix", "turn", "vocab"):
                lv = "token"
            else:
                lv = max(args, key=LEVELS.index)
        out[n] = lv
        return lv
    visit(root)
    return out


class Reductions:
    """The Reference's reductions (it holds the batch, the mask, the levels, the mutation and the flags)."""

    def reduce(self, n, entry):
        """A reduction at each token: over what it reads (its members), 0 where it reads nothing."""
        over, kind = REDUCTIONS[n.op]
        if over == "vocab":          # the token's support, entry by entry
            x = self.eval(n.args[0], entry=True)
            return Dual(x.v.sum(-1), x.g.sum(-2), x.d.any(-2))
        x = self.eval(n.args[0])
        q = float(self.eval(n.args[1]).v.flat[0]) if kind == "quantile" else None
        members, vals, grads, deps = self.members(over, self.level[n.args[0]], x, kind)
        out = self.none(np.zeros((self.B, self.T)))
        for b in range(self.B):
            for t in range(self.T):
                out.v[b, t], out.g[b, t], out.d[b, t] = self.kind(kind, vals, grads, deps, members[b, t], q)
        return out

    def members(self, over, level, x, kind):
        """[B, T, K] which elements each token's reduction reads, the K elements' values and gradients:
        a group or batch reduction of a value one per response (or wider) reads each non-empty
        response once (at its first unmasked token, where its value is); anything else the unmasked
        tokens of its response, prefix, turn, group at the same position, or batch."""
        B, T, mask = self.B, self.T, self.mask
        with np.errstate(all="ignore"):
            if over in ("group", "batch") and level != "token":
                first = mask.argmax(-1)
                vals, grads, deps = x.v[np.arange(B), first], x.g[np.arange(B), first], x.d[np.arange(B), first]
                groups = self.b["groups"]
                mates = groups[:, None] == groups[None, :] if over == "group" else np.ones((B, B), dtype=bool)
                self.undefined |= bool(np.isnan(vals[mask.any(-1)]).any())
                nonempty = mask.any(-1) | (self.mutation == "empty_group_member")
                return np.broadcast_to((mates & nonempty[None, :])[:, None, :], (B, T, B)), vals, grads, deps
            vals, grads, deps = x.v.reshape(-1), x.g.reshape(B * T, self.N), x.d.reshape(B * T, self.N)
            self.undefined |= bool(np.isnan(vals[mask.reshape(-1)]).any())
            b, t = np.arange(B)[:, None, None, None], np.arange(T)[None, :, None, None]
            c, s = np.arange(B)[None, None, :, None], np.arange(T)[None, None, None, :]
            same = b == c
            if over == "prefix":
                within = same & ((s < t) if self.mutation == "prefix_exclusive" else (s <= t))
            elif over == "turn":
                turns = self.b["turns"]
                within = same & ((turns[b, t] == turns[c, s]) | (self.mutation == "turn_is_response"))
            elif over == "group":
                groups = self.b["groups"]
                within = (groups[b] == groups[c]) & (s == t)
            elif over == "batch":
                within = np.ones((1, 1, B, T), dtype=bool)
            else:
                within = same & (s >= 0)
            if self.mutation == "mask_multiplies" and kind in ("sum", "mean"):
                # every element of the span, masked ones multiplied by 0 (NaN·0 is NaN)
                vals = vals * mask.reshape(-1)
                span = np.broadcast_to(within, (B, T, B, T)).reshape(B, T, B * T)
                return span, vals, grads * mask.reshape(-1, 1), deps
            return np.broadcast_to(within & mask[c, s], (B, T, B, T)).reshape(B, T, B * T), vals, grads, deps

    def kind(self, kind, vals, grads, deps, member, q):
        """The kind's value, gradient and dependence over the member elements (0 over none)."""
        v, G, D = vals[member], grads[member], deps[member]
        n = len(v)
        zero = (0.0, np.zeros(self.N), np.zeros(self.N, dtype=bool))
        if n == 0:
            return zero
        with np.errstate(all="ignore"):
            if kind == "sum":
                return v.sum(), G.sum(0), D.any(0)
            if kind == "mean":
                return v.sum() / n, G.sum(0) / n, D.any(0)
            if kind == "count":
                return (float(n),) + zero[1:]
            if kind in ("max", "min"):
                m = v.max() if kind == "max" else v.min()
                if np.isnan(m):
                    return m, np.full(self.N, np.nan), np.ones(self.N, dtype=bool)
                self._near_set(v, [m])
                ties = np.flatnonzero(v == m)[:1 if self.mutation == "tie_to_first" else None]
                return m, G[ties].mean(0), D[ties].any(0)
            if kind == "std":
                if n < 2 or (v == v[0]).all():     # 0, with a zero gradient, below two or all equal
                    return zero
                d = v - v.mean()
                ddof = 0 if self.mutation == "std_ddof_0" else 1
                var = (d * d).sum() / (n - ddof)
                s = math.sqrt(var)
                return s, scaled(d, G, D).sum(0) / ((n - ddof) * s), D.any(0)
            if kind == "quantile":
                if np.isnan(v).any():
                    return np.nan, np.full(self.N, np.nan), np.ones(self.N, dtype=bool)
                order = np.sort(v)
                rank = q * (n - 1)
                lo, hi = math.floor(rank), math.ceil(rank)
                f = rank - lo
                low, high = order[lo], order[hi]
                self._near_set(v, [low, high])
                if self.mutation == "quantile_lower":
                    return low, G[v == low].mean(0), D[v == low].any(0)
                if self.mutation == "quantile_weights_swapped":
                    f = 1 - f
                value = low if low == high else low + f * (high - low)
                grad = (1 - f) * G[v == low].mean(0) + (f * G[v == high].mean(0) if f else 0.0)
                return value, grad, D[v == low].any(0) | (D[v == high].any(0) if f else False)
        raise NoSemantics(f"the reduction kind {kind!r}")

    def _near_set(self, v, picks):
        """fragile where an element differs from a picked order statistic by rounding alone"""
        for p in picks:
            gap = np.abs(v - p)
            self.fragile |= bool(((v != p) & (gap <= NEAR * max(abs(p), 1.0))).any())
