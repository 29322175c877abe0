"""An independent float64 reference for the differential test (tests/test_differential.py): each
operation's meaning written here from docs/language.md and docs/api.md, evaluated in forward mode
with dual numbers over numpy (tests/dual_numbers.py: a value and its gradient with respect to every
input element, each token's log π, each token's H, each entry of the vocabulary support); the
reductions in tests/reference_reductions.py. It walks the parsed IR's nodes
and reads nothing else of the project: not the operations table's lowerings, derivatives or
adjoints, not dsl.levels, not openrlhf_drpo.core. A node it has no meaning for raises NoSemantics,
naming it (fail closed: the test then fails on that row).

`mutation` switches one rule to a known-wrong one (MUTATIONS): the mutation tests show that the
differential test fails when the reference is wrong. Where a comparison is decided by rounding alone
(two values within 1e-9 of each other but not equal) the result is `fragile`: which branch a path
takes there is no question of meaning, so the test does not compare such a case. Where the objective
is NaN at an unmasked token and a reduction, a comparison, min, max or clip reads that NaN, the
result is `undefined`: docs/language.md does not say what a comparison with NaN decides, nor what
gradient a reduction that ignores its element's value (a standard deviation of one) passes back. So is
a gradient made NaN by a product rule's 0·∞ or ∞ − ∞ (forward mode's order; reverse mode sums the
adjoints first and may give ±∞, and the limit may be either)."""
from __future__ import annotations

import functools
import math

import numpy as np

from dual_numbers import NEAR, Dual, NoSemantics, scaled
from reference_reductions import REDUCTIONS, Reductions, levels

CLAMP = 20.0            # r = exp(clamp(log π − log μ, −20, 20)) (docs/api.md)
# the log of each probability is the log-prob itself (docs/language.md: exact for tiny π_ref)
LOG_PROBS = {"pi": "logp", "mu": "anchor", "pi_old": "old", "pi_rollout": "rollout", "pi_ref": "ref",
             "pi_v": "vocab_logp", "pi_ref_v": "vocab_ref"}
COMPARISONS = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
               "ne": np.not_equal}
LOGIC = {"and": np.logical_and, "or": np.logical_or}
# the known-wrong rules the mutation tests switch on, one at a time
MUTATIONS = {
    "std_ddof_0": "group_std as the population standard deviation (ddof = 0)",
    "turn_is_response": "turn_sum and turn_mean over the whole response, the turn ids ignored",
    "quantile_weights_swapped": "a quantile's interpolation weights swapped (f on the lower neighbour)",
    "mask_multiplies": "a reduction multiplies masked elements by 0 instead of leaving them out",
    "tie_to_first": "a maximum's or minimum's gradient all to the first element attaining it",
    "quantile_lower": "a quantile is its lower order statistic (no interpolation)",
    "prefix_exclusive": "prefix_sum(x) at t sums s < t (exclusive)",
    "empty_group_member": "a group or batch reduction of a response-level value counts empty responses",
    "ratio_unclamped": "r = exp(log π − log μ), without the clamp at ±20",
    "min_tie_to_second": "min(a, b) gives a tie's gradient to b",
    "token_mean_counts_padding": "token-mean divides by every position, masked ones too",
}


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


_ERF = np.frompyfunc(math.erf, 1, 1)
# value, and derivative as a function of (x, value): each function from the language's list
UNARY = {
    "exp": (np.exp, lambda x, y: y), "sqrt": (np.sqrt, lambda x, y: 1 / (2 * y)),
    "abs": (np.abs, lambda x, y: np.sign(x)), "atan": (np.arctan, lambda x, y: 1 / (1 + x * x)),
    "erf": (lambda x: _ERF(x).astype(float), lambda x, y: 2 / math.sqrt(math.pi) * np.exp(-x * x)),
    "softsign": (lambda x: x / (1 + np.abs(x)), lambda x, y: 1 / (1 + np.abs(x)) ** 2),
    "tanh": (np.tanh, lambda x, y: 1 / np.cosh(x) ** 2), "sigmoid": (_sigmoid, lambda x, y: _sigmoid(x) * _sigmoid(-x)),
    "softplus": (lambda x: np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0), lambda x, y: _sigmoid(x)),
    "log": (np.log, lambda x, y: 1 / x),
}


class Reference(Reductions):
    """One objective on one batch (a dict of numpy arrays: tests/adversarial_batches.py)."""

    def __init__(self, obj, batch: dict, mutation: str | None = None):
        if mutation is not None and mutation not in MUTATIONS:
            raise ValueError(f"unknown mutation {mutation!r}")
        self.obj, self.b, self.mutation = obj, batch, mutation
        self.params = {k: float(v) for k, v in obj.params.items()}
        self.mask = batch["mask"].astype(bool)
        B, T = self.mask.shape
        k = batch["vocab_logp"].shape[-1]
        self.B, self.T, self.k = B, T, k
        self.N = 2 * B * T + B * T * k          # log π, H, then the support's log π
        self.level = levels(obj.expr)
        self.memo: dict = {}
        self.fragile = False
        self.undefined = False
        self.indeterminate = False          # the product rule met 0·∞ or ∞ − ∞ (selecting)
        self.anchor = batch["rollout"] if obj.options["anchor"] == "rollout" else batch["old"]
        np.seterr(all="ignore")       # IEEE arithmetic is the meaning on masked slots (selected out)

    # ------------------------------------------------------------ leaves
    def seed(self, values, offset):
        g = np.zeros(values.shape + (self.N,))
        idx = np.arange(values.size).reshape(values.shape)
        np.put_along_axis(g, (idx + offset)[..., None], 1.0, axis=-1)
        return g

    def zeros(self, shape):
        return np.zeros(shape + (self.N,))

    def none(self, values):
        """values with no gradient and no dependence on any input."""
        return Dual(values, self.zeros(values.shape), np.zeros(values.shape + (self.N,), dtype=bool))

    def seeded(self, values, offset):
        g = self.seed(values, offset)
        return Dual(values, g, g != 0)

    def constant(self, x, entry):
        shape = (self.B, self.T, self.k) if entry else (self.B, self.T)
        return self.none(np.full(shape, float(x)))

    def raw_ratio(self):
        return self.b["logp"] - self.anchor

    def log_of(self, name, entry):
        """log(p) of a built-in probability: the log-prob itself, with its gradient where it is π's."""
        if name == "r":
            raw = self.raw_ratio()
            if self.mutation == "ratio_unclamped":
                return self.seeded(raw, 0)
            keep = ((raw >= -CLAMP) & (raw <= CLAMP))[..., None]     # the clamp selects: no dependence where active
            g = self.seed(raw, 0) * keep
            return Dual(np.clip(raw, -CLAMP, CLAMP), g, (g != 0) & keep)
        if name == "mu":
            return self.none(self.anchor.copy())
        x = self.b[LOG_PROBS[name]]
        if name == "pi":
            return self.seeded(x.copy(), 0)
        if name == "pi_v":
            return self.seeded(x.copy(), 2 * self.B * self.T)
        return self.none(x.copy())

    def var(self, name, entry):
        B, T = self.B, self.T
        if name in LOG_PROBS or name == "r":
            lg = self.log_of(name, entry)
            v = np.exp(lg.v)
            return Dual(v, scaled(v, lg.g, lg.d), lg.d)
        if name == "H":
            return self.seeded(self.b["H"].copy(), B * T)
        if name in ("A", "sum_pi_sq", "staleness"):
            return self.none(self.b[name].copy())
        if name == "seq_len":
            n = self.mask.sum(-1, keepdims=True).astype(float)
            return self.none(np.broadcast_to(n, (B, T)).copy())
        if name == "turn_len":
            turns = self.b["turns"]
            same = turns[:, :, None] == turns[:, None, :]
            return self.none((same & self.mask[:, None, :]).sum(-1).astype(float))
        raise NoSemantics(f"the built-in {name!r}")

    # ------------------------------------------------------------ the walk
    def eval(self, n, entry=False):
        key = (n, entry)
        if key not in self.memo:
            self.memo[key] = self._eval(n, entry)
        return self.memo[key]

    def _eval(self, n, entry):
        if n.op == "num":
            return self.constant(n.value, entry)
        if n.op == "param":
            return self.constant(self.params[n.value], entry)
        if n.op == "var":
            return self.var(n.value, entry)
        if n.op in COMPARISONS or n.op in LOGIC or n.op == "not":
            raise NoSemantics(f"the condition {n.op!r} used as a number")
        if n.op == "log" and n.args[0].op == "var" and (n.args[0].value in LOG_PROBS or n.args[0].value == "r"):
            return self.log_of(n.args[0].value, entry)
        if n.op in REDUCTIONS:
            return self.reduce(n, entry)
        if n.op in ("mul", "div", "neg"):
            return self.selecting(n, entry)
        if n.op in UNARY:
            x = self.eval(n.args[0], entry)
            f, d = UNARY[n.op]
            with np.errstate(all="ignore"):
                y = f(x.v)
                return Dual(y, scaled(d(x.v, y), x.g, x.d), x.d)
        if n.op in ("sign", "sg"):
            x = self.eval(n.args[0], entry)
            if n.op == "sign":
                self.near(x.v, np.zeros_like(x.v), entry, absolute=True)
            return self.none(np.sign(x.v) if n.op == "sign" else x.v)
        if n.op == "ind":
            return self.none(self.cond(n.args[0], entry).astype(float))
        if n.op in ("add", "sub"):
            a, b = self.eval(n.args[0], entry), self.eval(n.args[1], entry)
            s = 1 if n.op == "add" else -1
            return Dual(a.v + s * b.v, a.g + s * b.g, a.d | b.d)
        if n.op == "pow":
            return self.power(self.eval(n.args[0], entry), self.eval(n.args[1], entry))
        if n.op in ("min", "max"):
            return self.extreme(n.op, [self.eval(a, entry) for a in n.args], entry)
        if n.op == "clip":
            x, lo, hi = (self.eval(a, entry) for a in n.args)
            return self.extreme("min", [self.extreme("max", [x, lo], entry), hi], entry)
        raise NoSemantics(f"the operation {n.op!r}")

    def cond(self, n, entry):
        """A condition's truth, per element (no gradient)."""
        if n.op in COMPARISONS:
            a, b = self.eval(n.args[0], entry), self.eval(n.args[1], entry)
            self.near(a.v, b.v, entry)
            return COMPARISONS[n.op](a.v, b.v)
        if n.op in LOGIC:
            return LOGIC[n.op](self.cond(n.args[0], entry), self.cond(n.args[1], entry))
        if n.op == "not":
            return ~self.cond(n.args[0], entry)
        raise NoSemantics(f"the condition {n.op!r}")

    def near(self, a, b, entry, absolute=False):
        """Marks the case fragile where an unmasked comparison is decided by rounding."""
        keep = self.mask[..., None] if entry else self.mask
        keep = np.broadcast_to(keep, np.broadcast(a, b).shape)
        with np.errstate(all="ignore"):
            gap = np.abs(a - b)
            tol = 1e-12 if absolute else NEAR * np.maximum(np.maximum(np.abs(a), np.abs(b)), 1.0)
            close = keep & (a != b) & (gap <= tol)
        self.fragile |= bool(close.any())
        self.undefined |= bool((keep & (np.isnan(a) | np.isnan(b))).any())

    def selecting(self, n, entry):
        """A product, quotient or negation; where an indicator is one of its factors (through
        products, negations and numerators) and its condition fails, 0 with a gradient of 0, whatever
        the rest holds there (docs/language.md: selected, not multiplied)."""
        args = [self.eval(a, entry) for a in n.args]
        with np.errstate(all="ignore"):
            if n.op == "neg":
                out = Dual(-args[0].v, -args[0].g, args[0].d)
            elif n.op == "mul":
                a, b = args
                out = Dual(a.v * b.v, scaled(b.v, a.g, a.d) + scaled(a.v, b.g, b.d), a.d | b.d)
            else:
                a, b = args
                q = a.v / b.v
                out = Dual(q, scaled(1 / b.v, a.g, a.d) - scaled(q / b.v, b.g, b.d), a.d | b.d)
            # 0·∞ or ∞ − ∞ in the product rule (H/group_std(√H) at H = 0): forward mode gives NaN where
            # reverse mode sums the adjoints first (±∞), and the limit may be either: undefined where
            # such a NaN reaches the loss's gradient (loss() checks), not where a selection drops it
            nan_in = functools.reduce(np.logical_or, [np.isnan(x.g) for x in args])
            born = np.isnan(out.g) & ~nan_in & np.isfinite(out.v)[..., None]
            self.indeterminate |= bool((born.any(-1) & self.keep(out.v.ndim)).any())
        conds = self.factor_conditions(n)
        if not conds:
            return out
        keep = np.logical_and.reduce([self.cond(c, entry) for c in conds])
        return Dual(np.where(keep, out.v, 0.0), np.where(keep[..., None], out.g, 0.0), out.d & keep[..., None])

    def factor_conditions(self, n):
        if n.op == "ind":
            return [n.args[0]]
        if n.op == "mul":
            return self.factor_conditions(n.args[0]) + self.factor_conditions(n.args[1])
        if n.op in ("neg", "div"):
            return self.factor_conditions(n.args[0])
        return []

    def power(self, a, b):
        with np.errstate(all="ignore"):
            y = np.power(a.v, b.v)
            # d(a^b)/da = b·a^(b−1), 0 at b = 0 (a^0 is 1 for every a); d(a^b)/db = a^b·log a, 0 at a = 0 < b
            # (0^b is 0 for every b > 0); at 0^0, where b varies, undefined (0^b jumps from 1 to 0)
            da = scaled(np.where(b.v == 0, 0.0, b.v * np.power(a.v, b.v - 1)), a.g, a.d)
            db = scaled(np.where((a.v == 0) & (b.v > 0), 0.0, y * np.log(a.v)), b.g, b.d)
        self.undefined |= bool(((a.v == 0) & (b.v == 0) & b.d.any(-1) & self.keep(a.v.ndim)).any())
        return Dual(y, da + db, a.d | b.d)

    def keep(self, ndim):
        """The unmasked positions, for a token's value (ndim 2) or an entry's (3)."""
        return self.mask if ndim == 2 else self.mask[..., None]

    def extreme(self, op, xs, entry):
        """min/max: the first argument attaining the extreme, its value and its gradient alone (the
        dropped arguments pass none, even a non-finite one); NaN where none attains it (a NaN)."""
        better = np.less_equal if op == "min" else np.greater_equal
        v = np.full(np.broadcast(*[x.v for x in xs]).shape, np.nan)
        g = np.full(v.shape + (self.N,), np.nan)
        dep = np.ones(g.shape, dtype=bool)
        taken = np.zeros(v.shape, dtype=bool)
        order = list(range(len(xs)))
        if self.mutation == "min_tie_to_second" and op == "min" and len(xs) == 2:
            order = [1, 0]
        for i in order:
            wins = ~taken
            for j, y in enumerate(xs):
                if j != i:
                    wins &= better(xs[i].v, y.v)
                    self.near(xs[i].v, y.v, entry)
            v = np.where(wins, xs[i].v, v)
            g = np.where(wins[..., None], xs[i].g, g)
            dep = np.where(wins[..., None], xs[i].d, dep)
            taken |= wins
        return Dual(v, g, dep)

    # ------------------------------------------------------------ the loss
    def loss(self) -> dict:
        """The loss by docs/language.md's aggregation table (a given normalizer replaces the count, host
        weights multiply each term), and its gradients; 0 and no gradient where no token is unmasked."""
        B, T, mask = self.B, self.T, self.mask
        ell = self.eval(self.obj.expr)
        v, g = np.broadcast_to(ell.v, (B, T)), np.broadcast_to(ell.g, (B, T, self.N))
        mode = self.b.get("mode") or self.obj.options["aggregate"]
        m = mask.astype(float)
        n_y = m.sum(-1, keepdims=True)
        if mode == "token-mean":
            coef, count = np.ones((B, T)), (B * T if self.mutation == "token_mean_counts_padding" else m.sum())
        else:
            per = {"seq-mean-token-mean": 1 / (n_y + 1e-8), "seq-mean-token-sum": 1.0,
                   "seq-mean-token-sum-norm": 1 / max(T, 1)}[mode]
            coef, count = np.broadcast_to(per * (n_y > 0), (B, T)), float((n_y > 0).sum())
        if self.b.get("weights") is not None:
            coef = coef * self.b["weights"]
        out = {"loss": 0.0, "logp": np.zeros((B, T)), "H": np.zeros((B, T)), "vocab": np.zeros((B, T, self.k))}
        if mask.any():
            norm = self.b.get("norm")
            N = count if norm is None else norm
            with np.errstate(all="ignore"):
                out["loss"] = -np.where(mask, coef * v, 0.0).sum() / N
                grad = -np.where(mask[..., None], coef[..., None] * g, 0.0).sum((0, 1)) / N
            out["logp"] = grad[:B * T].reshape(B, T)
            out["H"] = grad[B * T:2 * B * T].reshape(B, T)
            out["vocab"] = grad[2 * B * T:].reshape(B, T, self.k)
        nan_gradient = any(np.isnan(out[k]).any() for k in ("logp", "H", "vocab"))
        out["fragile"], out["undefined"] = self.fragile, self.undefined or (self.indeterminate and nan_gradient)
        return out


def reference(obj, batch: dict, mutation: str | None = None) -> dict:
    """{loss, logp, H, vocab (gradients), fragile, undefined} of the objective on the batch, in float64."""
    return Reference(obj, batch, mutation).loss()
