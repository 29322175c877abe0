"""A parsed objective: its IR, parameters and options, with what every consumer asks of it
(its canonical text, the built-ins it reads, a copy with overrides) and the check that every
constant in it is a finite real number; and the options the language has."""
from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass, field
from fractions import Fraction

from dsl.controls import STEP, at_values
from dsl.errors import DslError
from dsl.ir import Node, Pos, num, postorder, rebuild, tree_size
from dsl.levels import PER_RESPONSE, Facts, facts
from dsl.names import canonical_name, display_name
from dsl.operations import OPS
from dsl.printing import RENDER_LIMIT, render
from dsl.source import did_you_mean
from dsl.walks import constant_nodes

OPTIONS = {
    "anchor": ("old", "rollout"),
    "aggregate": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm"),
}
OPTION_DEFAULTS = {"anchor": "old", "aggregate": "token-mean"}


@dataclass
class Objective:
    """A parsed objective: the inlined IR plus everything needed to print or rebuild it."""
    name: str
    path: str
    source: str
    expr: Node                       # bindings inlined; parameters stay 'param' nodes
    params: dict[str, Fraction]      # ASCII name -> value
    options: dict[str, str]
    bindings: dict[str, Node] = field(default_factory=dict)
    description: str = ""
    declared: frozenset = frozenset()     # the options the file or an override sets (the rest: OPTION_DEFAULTS)
    controls: dict = field(default_factory=dict)   # name -> dsl.controls.Control: the parameters with a rule

    def check_constants(self) -> "Objective":
        """Every sub-expression without r, π, μ or A is a finite real number at the current
        parameter values: log(0), 1/(2δ) at δ = 0, exp(1000), (-2)^0.5 are located errors here,
        not a crash or an inf or NaN in a training step. Children are checked before their
        parents, so the error names the innermost culprit."""
        env = {k: float(v) for k, v in self.params.items()}
        constant = constant_nodes(self.expr)
        values: dict = {}
        for n in postorder(self.expr):
            _check_ranges(self, n, values, env)
            # a constant zero divisor makes the quotient infinite, constant or not
            if n.op == "div" and values.get(n.args[1]) == 0:
                self._constant_error(n.args[1], f"division by zero: '{render(n.args[1])}' is 0", env)
            if n not in constant:
                continue
            if n.op == "num":
                values[n] = float(n.value)
            elif n.op == "param":
                values[n] = env[n.value]
            else:
                args = [values[a] for a in n.args]
                try:
                    values[n] = OPS[n.op].py(*args)
                except (ValueError, ZeroDivisionError, OverflowError):
                    values[n] = None
                if OPS[n.op].kind == "num" and (values[n] is None or not math.isfinite(values[n])):
                    why = _not_real(n.op, args)
                    what = f"'{render(n)}' is not a {'real' if why else 'finite'} number"
                    self._constant_error(n, what, env, why)
        return self

    def _constant_error(self, n: Node, what: str, env: dict, why: str | None = None, hint: str | None = None):
        values = ", ".join(f"{display_name(k)} = {render(num(v))}" for k, v in self.params.items()
                           if any(m.op == "param" and m.value == k for m in n.walk()))
        pos = n.pos or Pos(1, 1)
        src = self.source.split("\n")[pos.line - 1] if pos.line <= self.source.count("\n") + 1 else None
        raise DslError(what + (f" at {values}" if values else "") + (f": {why}" if why else ""), self.path,
                       pos.line, pos.col, src,
                       hint or f"a sub-expression of parameters and numbers only must be a finite {'real ' * bool(why)}number")

    def names(self) -> set[str]:
        """The built-ins the objective reads (r, pi, mu, A, pi_old, pi_rollout, seq_len, pi_ref, H, sum_pi_sq)."""
        return {n.value for n in self.expr.walk() if n.op == "var"}

    @property
    def facts(self) -> Facts:
        """Where its values live (dsl.levels.Facts), each computed once for its expression."""
        return facts(self.expr)

    def locality(self) -> str:
        """token, response, group or batch: the widest reduction a value of the current policy
        passes through (dsl.levels.Facts.locality)."""
        return self.facts.locality

    def by_position(self) -> list[str]:
        """One sentence per group reduction that reads a per-response value (A) at token level
        (Facts.by_position_only): what it does there and the form that reduces each response once,
        e.g. group_mean(seq_mean(A)). The analysis warns, and so does CompiledLoss."""
        return _by_position(self)

    def reads_rollout(self) -> bool:
        """Whether training needs the rollout engine's log-probs (μ is them, or π_rollout is named)."""
        return self.options["anchor"] == "rollout" or "pi_rollout" in self.names()

    def canonical(self) -> str:
        """Parameters, options, bindings and the objective, each inlined; if that would be
        longer than RENDER_LIMIT operations, bindings are referred to by name."""
        names = {v: k for k, v in self.bindings.items()} if tree_size(self.expr) > RENDER_LIMIT else None
        # `step` is the loss core's to set: a comment, so that the text still parses
        lines = [f"{'# ' * (k == STEP)}{display_name(k)} = {render(num(v))}" for k, v in self.params.items()
                 if k != STEP or v != 0]
        lines += [f"@{k} = {v}" for k, v in self.options.items()]
        lines += [c.text() for c in self.controls.values()]
        lines += [f"{display_name(k)} = {render(v, names)}" for k, v in self.bindings.items()]
        last = display_name(names[self.expr]) if names and self.expr in names else render(self.expr, names)
        return "\n".join(lines + [last])

    def with_overrides(self, params: dict | None = None, options: dict | None = None,
                       where: str = "<overrides>") -> "Objective":
        """A copy with parameter/option values replaced; unknown names are located errors."""
        new_params, new_options, given = dict(self.params), dict(self.options), {}
        for raw, value in (params or {}).items():
            name = param_key(raw)
            text = f"{raw}={value}"
            if name in given:
                raise DslError(f"parameter '{display_name(name)}' is set twice: {given[name]} and {text}", where, 1, 1,
                               text, "keep one of them")
            given[name] = text
            if name not in self.params:
                known = ", ".join(display_name(k) for k in self.params) or "none"
                raise DslError(f"unknown parameter '{raw}' for objective '{self.name}'", where, 1, 1,
                               text, f"its parameters are: {known}{did_you_mean(name, self.params)}")
            new_params[name] = _finite_number(value, where, text, len(str(raw)) + 2)
        controls = _controls_at(self.controls, new_params, given, where) if given else self.controls
        for key, value in (options or {}).items():
            check_option(key, str(value), where, 1, 1, f"{key}={value}", len(key) + 2)
            new_options[key] = str(value)
        return Objective(self.name, self.path, self.source, self.expr, new_params, new_options,
                         self.bindings, self.description, self.declared | set(options or {}),
                         controls).check_constants()


def _controls_at(controls: dict, params: dict, given: dict, where) -> dict:
    """The controls at the overridden values: a bound that is a parameter moves with it, and a target
    or a horizon set to 0 is refused as in the file (dsl.controls.at_values), located at the override."""
    try:
        return at_values(controls, params)
    except ValueError as e:
        message, read, c = e.args
        text = next((given[k] for k in given if k in read), next(iter(given.values())))
        raise DslError(message, where, 1, text.index("=") + 2, text, f"'{display_name(c.name)}' is controlled: "
                       f"{c.text()}") from None


def param_key(raw) -> str:
    """The parameter a user's spelling names, as in a file: NFKC, then ASCII (ϵ, ε, eps and
    epsilon are one name)."""
    return canonical_name(unicodedata.normalize("NFKC", str(raw)))



def _finite_number(value, where, text, col) -> Fraction:
    """A decimal (0.2, .5, 1e-3) or exact fraction (1/5) that is finite, as an exact Fraction."""
    text_value = repr(value) if isinstance(value, float) else str(value).strip()
    try:
        # finite as a float before Fraction: Fraction("1e99999999") builds a huge integer
        v = Fraction(text_value) if "/" in text_value or math.isfinite(float(text_value)) else None
        if v is not None:
            float(v)                  # 1e999/1 overflows here
    except (ValueError, ZeroDivisionError, OverflowError):
        v = None
    if v is None or isinstance(value, bool):
        raise DslError(f"parameter value '{value}' is not a finite number", where, 1, col, text,
                       "write a decimal number such as 0.2, .5 or 1e-3")
    return v



def _not_real(op: str, args: list) -> str | None:
    """Why a constant has no real value, where real arithmetic has none (torch gives NaN)."""
    return OPS[op].not_real(*args) if OPS[op].not_real else None



def check_option(key, value, path, line, col, source_line, value_col):
    if key not in OPTIONS:
        raise DslError(f"unknown option '@{key}'", path, line, col, source_line,
                       f"options are: {', '.join('@' + k for k in OPTIONS)}{did_you_mean('@' + key, ['@' + k for k in OPTIONS])}")
    if value not in OPTIONS[key]:
        raise DslError(f"'{value}' is not a value of @{key}", path, line, value_col, source_line,
                       f"@{key} is one of: {', '.join(OPTIONS[key])}")


def parse_overrides(pairs: list[str], flag: str = "--set") -> dict[str, str]:
    """--set NAME=VALUE pairs (drpo-analyze; drpo-train's flag is --drpo.set) as {name: value}; naming one
    parameter twice, in any spelling, is an error located at the flag the user typed."""
    out, seen = {}, {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise DslError("expected name=value", flag, 1, 1, pair, f"e.g. {flag} delta=0.2")
        key = param_key(name.strip())
        if key in seen:
            raise DslError(f"'{name.strip()}' is set twice: {seen[key]} and {pair}", flag, 1, 1, pair,
                           "keep one of them")
        seen[key] = pair
        out[name.strip()] = value
    return out


def _swapped(n: Node, swap: dict) -> Node:
    return rebuild(n, lambda m, args: swap.get(m))


def _check_ranges(obj: Objective, n: Node, values: dict, env: dict) -> None:
    """Each constant argument of n in its row's range (Op.constants: batch_quantile's q in [0, 1])."""
    for i, lo, hi in OPS[n.op].constants if n.op in OPS else ():
        if not lo <= values[n.args[i]] <= hi:
            obj._constant_error(n.args[i], f"{n.op}'s argument {i + 1} '{render(n.args[i])}' is "
                                f"{values[n.args[i]]:g}, outside [{lo}, {hi}]", env,
                                hint=f"write {OPS[n.op].signature} with a value in [{lo}, {hi}]")


def _by_position(obj: Objective) -> list[str]:
    out = []
    by_response = {m for m, lv in obj.facts.level_per_response.items() if lv != "token"}
    whole = {m for m, lv in obj.facts.level.items() if lv != "token"}
    for n in obj.facts.by_position_only:
        held = sorted({m.value for m in n.walk() if m.op == "var" and m.value in PER_RESPONSE})
        swap = {m: Node("seq_mean", (m,)) for m in n.walk() if m.op == "var" and m.value in PER_RESPONSE}
        # a prefix mean of a per-response value is that value (dsl.levels): the fix drops it
        swap.update({m: m.args[0] if m.args[0] in whole else _swapped(m.args[0], swap) for m in n.walk()
                     if m.op == "prefix_mean" and m in by_response})
        out.append(f"{render(n)} reduces a token-level value position by position: {', '.join(held)} is one value "
                   f"per response in every host, so past the end of a group's shorter responses a longer one's tokens "
                   f"are compared with fewer others or none (with none, group_mean(A) is its own A and group_std(A) is 0); write "
                   f"{render(_swapped(n, swap))} to reduce each response once")
    return out
