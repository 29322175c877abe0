"""Random objectives for the differential test, drawn from the operations table (dsl.operations.OPS)
as PyTorch's OpInfo draws its tests: every row a user can write (WRITABLE: each row written by its
own symbol, brackets, arity and kinds, kept where the real parser builds that row from it) is drawn,
so a new row is drawn without being listed here. Each draw is seeded by (seed, index): depth 2 to 4,
every built-in, numbers and parameters, a binding used at least twice, a random @aggregate and
@anchor. The real parser decides what is an objective: a draw it refuses (a DslError) is discarded
and counted by its message, never patched."""
from __future__ import annotations

import random
import re
import warnings
from dataclasses import dataclass, field

import dsl
from dsl.names import BUILTINS, ENTRIES, display_name
from dsl.objective import OPTIONS
from dsl.operations import OPS, passes_no_gradient

NUMBERS = ("0.5", "2", "1", "0.1", "3", "1e-3", "0.25", "1.5")
QUANTILES = ("0", "1", "0.5", "0.3", "0.25", "0.9")
EXPONENTS = ("2", "3", "0.5", "-1", "1.5")
PARAMS = {"δ": ("0.2", "2", "0.5"), "ε": ("0.1", "0.3"), "β": ("0.04", "1.5"), "κ": ("0.5", "0.75")}
POLICY = ("r", "π", "H")


@dataclass
class G:
    """A drawn expression: a leaf's text, or a row of OPS over drawn arguments (a constant argument,
    as a quantile's q, is a leaf)."""
    op: str | None
    args: list = field(default_factory=list)
    text: str = ""
    brackets: bool = False       # abs written |x|
    constant: bool = False       # a constant argument (a quantile's q): never a binding's use

    def render(self) -> str:
        if self.op is None:
            return self.text
        row, a = OPS[self.op], [x.render() for x in self.args]
        if row.brackets and (self.brackets or not row.callable):
            return f"{row.brackets[0]}{a[0]}{row.brackets[1]}"
        if row.callable:
            return f"{self.op}({', '.join(a)})"
        if len(a) == 1:
            return f"{row.symbol.strip()} ({a[0]})" if row.symbol.strip().isalpha() else f"{row.symbol}({a[0]})"
        return f"({a[0]}) {row.symbol} ({a[1]})"

    def nodes(self):
        yield self
        for x in self.args:
            yield from x.nodes()


@dataclass
class Spec:
    """A drawn objective: its parameters, options, one binding and the objective itself."""
    expr: G
    params: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    bindings: dict = field(default_factory=dict)

    def text(self) -> str:
        lines = [f"{k} = {v}" for k, v in self.params.items()]
        lines += [f"@{k} = {v}" for k, v in self.options.items()]
        lines += [f"{k} = {v.render()}" for k, v in self.bindings.items()]
        return "\n".join(lines + [self.expr.render()])


def writing(name: str) -> str:
    """Row `name` written by its own symbol, brackets, arity and kinds, on r (a condition r < 1, π_v in
    a vocabulary sum, a number in a constant argument), times r: an objective, if a user can write it."""
    row = OPS[name]
    consts = {i for i, *_ in row.constants}
    arg = "π_v" if row.over == "vocab" else "r < 1" if row.args_kind == "bool" else "r"
    text = G(name, [G(None, text="0.5" if i in consts else arg) for i in range(row.arity[0])]).render()
    return f"r*[{text}]" if row.kind == "bool" else f"r*{text}"


def _probe(name: str) -> bool:
    """Whether the parser builds row `name` from its writing: the rows a user can write."""
    try:
        return any(n.op == name for n in dsl.parse(writing(name)).expr.walk())
    except dsl.DslError:
        return False


WRITABLE = tuple(k for k in OPS if _probe(k))
LEAVES = tuple(display_name(k) for k in BUILTINS if k not in ENTRIES)
ENTRY_LEAVES = tuple(display_name(k) for k in ENTRIES)
# arguments kept positive where a row reads a positive one (a log or a root of anything else is
# mostly NaN: drawn too, less often)
POSITIVE = ("π", "μ", "r", "π_ref", "π_old", "π_rollout", "seq_len", "sum_π_sq")


class Drawer:
    def __init__(self, rng: random.Random):
        self.rng = rng
        self.params = {}
        self.binding = None
        vocab = [k for k in WRITABLE if OPS[k].over == "vocab"]
        self.support = rng.choice(vocab) if vocab else None     # one support per objective

    def leaf(self, entry: bool, policy: bool = False) -> G:
        rng = self.rng
        if policy:
            return G(None, text=rng.choice(ENTRY_LEAVES[:1] if entry else POLICY))
        if self.binding and not entry and rng.random() < 0.25:
            return G(None, text=self.binding)
        if rng.random() < 0.25:
            if self.params and rng.random() < 0.5:
                return G(None, text=rng.choice(list(self.params)))
            return G(None, text=rng.choice(NUMBERS))
        return G(None, text=rng.choice(ENTRY_LEAVES if entry else LEAVES))

    def rows(self, kind: str, entry: bool, policy: bool):
        """The rows of `kind` drawable here; on the policy's path, mostly rows that pass a gradient
        (sg, sign, [...] and the counts on it are drawn too, and then mostly refused by the parser)."""
        live = policy and kind == "num" and self.rng.random() < 0.9
        return [k for k in WRITABLE if OPS[k].kind == kind and not (entry and OPS[k].reduce)
                and (OPS[k].over != "vocab" or (k == self.support and not entry))
                and not (live and passes_no_gradient(k))]

    def draw(self, depth: int, kind: str = "num", entry: bool = False, policy: bool = False) -> G:
        """An expression of exactly `depth` (a leaf at 0); `policy`: its deepest path ends at π, r or H."""
        rng = self.rng
        if depth == 0:
            return self.leaf(entry, policy) if kind == "num" else self.draw(1, "bool", entry, policy)
        name = rng.choice(self.rows(kind, entry, policy))
        row = OPS[name]
        arity = row.arity[0] if row.arity[1] == row.arity[0] else rng.choice([row.arity[0], row.arity[0] + 1])
        consts = {i: (lo, hi) for i, lo, hi in row.constants}
        inner = entry or row.over == "vocab"
        spine = rng.choice([i for i in range(arity) if i not in consts])
        args = []
        for i in range(arity):
            if i in consts:
                q = [p for p in self.params if float(self.params[p]) <= consts[i][1]]
                args.append(G(None, text=rng.choice(q) if q and rng.random() < 0.3 else rng.choice(QUANTILES),
                              constant=True))
            elif name == "pow" and i == 1 and rng.random() < 0.9:
                args.append(G(None, text=rng.choice(EXPONENTS)))
            else:
                d = depth - 1 if i == spine else rng.randrange(depth)
                args.append(self.draw(d, row.args_kind, inner, (policy or row.over == "vocab") and i == spine))
        args = self.tame(name, args, inner)
        return G(name, args, brackets=rng.random() < 0.5)

    def tame(self, name: str, args: list, entry: bool) -> list:
        """Mostly finite: a log's or a root's argument 1 + x² or a positive leaf, a divisor 1 + x²,
        an exponential's argument x/8, each most of the time (the raw forms are drawn too)."""
        rng = self.rng
        if rng.random() < 0.25:
            return args
        square = lambda x: G("add", [G(None, text="1"), G("pow", [x, G(None, text="2")])])  # noqa: E731
        if name in ("log", "sqrt") and not (args[0].op is None and args[0].text in POSITIVE + ENTRY_LEAVES):
            return [square(args[0])]
        if name == "div" and not (args[1].op is None and args[1].text in POSITIVE):
            return [args[0], square(args[1])]
        if name == "exp":
            return [G("div", [args[0], G(None, text="8")])]
        return args


def draw_spec(rng: random.Random) -> Spec:
    d = Drawer(rng)
    for name in rng.sample(list(PARAMS), rng.randrange(3)):
        d.params[name] = rng.choice(PARAMS[name])
    bindings = {}
    if rng.random() < 0.6:
        bindings["b"] = d.draw(rng.randrange(1, 3))
        d.binding = "b"
    expr = d.draw(rng.choice((2, 3, 4)), policy=True)
    if bindings:           # the binding used at least twice
        leaves = [g for g in _token_leaves(expr) if g.text not in POLICY + ("b",) and not g.constant]
        uses = sum(g.op is None and g.text == "b" for g in expr.nodes())
        for g in rng.sample(leaves, min(len(leaves), max(0, 2 - uses))):
            g.text = "b"
        if sum(g.op is None and g.text == "b" for g in expr.nodes()) < 2:
            expr = G("add", [expr, G("mul", [G(None, text="b"), G(None, text="b")])])
    numbers = [g for g in _token_leaves(expr) if re.fullmatch(r"[\d.e-]+", g.text) and not g.constant]
    for name in list(d.params):        # each parameter used (in a number's place), or not declared
        trees = [expr, *bindings.values()]
        if not any(g.text == name for tree in trees for g in tree.nodes()):
            if numbers:
                numbers.pop(rng.randrange(len(numbers))).text = name
            else:
                del d.params[name]
    options = {k: rng.choice(v) for k, v in OPTIONS.items() if rng.random() < 0.6}
    return Spec(expr, d.params, options, bindings)


def _token_leaves(expr: G) -> list:
    """The leaves outside vocabulary sums (where a binding or a parameter may stand)."""
    out, stack = [], [expr]
    while stack:
        g = stack.pop()
        if g.op is None:
            out.append(g)
        elif OPS[g.op].over != "vocab":
            stack.extend(g.args)
    return out


def refusal(err: dsl.DslError) -> str:
    """A refusal's class: its message without the quoted parts."""
    return re.sub(r"'[^']*'|\d+(\.\d+)?", "…", err.message)[:90]


def objective(seed: int, index: int, discards: dict | None = None, tries: int = 50):
    """(Spec, parsed Objective) of draw `index` of `seed`: the first of its tries the parser accepts,
    each refusal counted in `discards` by class."""
    for attempt in range(tries):
        spec = draw_spec(random.Random(f"{seed}:{index}:{attempt}"))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return spec, dsl.parse(spec.text())
        except dsl.DslError as err:
            if discards is not None:
                discards[refusal(err)] = discards.get(refusal(err), 0) + 1
    raise RuntimeError(f"draw {seed}:{index}: no objective in {tries} tries")
