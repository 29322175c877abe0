"""Text -> IR. Lark parses the normalized text (dsl.source); this module loads files, builds
the IR itself (user text never reaches sympify or eval) and turns every problem into a
located DslError."""
from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass, field
from fractions import Fraction
from importlib import resources
from pathlib import Path

from .errors import DslError
from .ir import Node, Pos, num, postorder, tree_size
from .names import BUILTINS, canonical_name, display_name
from .operations import FUNCTIONS, OPS, passes_no_gradient
from .printing import RENDER_LIMIT, render
from .source import Source, _did_you_mean, _lookalike
from .walks import constant_nodes, evaluate

# Reductions wider than one response: refused by name, with the reason (an update's tokens are
# split across micro-batches and ranks, so a batch statistic would silently change with them).
BATCH_WIDE = ("mean", "sum", "std", "var", "median", "quantile", "percentile", "topk", "top_k", "kthvalue",
              "rank", "softmax", "logsumexp", "whiten", "normalize", "batch_mean", "batch_sum", "batch_max",
              "batch_min", "batch_std", "group_mean", "group_std", "argmax", "argmin", "cumsum", "cummax")

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

    def check_constants(self) -> "Objective":
        """Every sub-expression without r, π, μ or A is a finite real number at the current
        parameter values: log(0), 1/(2δ) at δ = 0, exp(1000), (-2)^0.5 are located errors here,
        not a crash or an inf or NaN in a training step. Children are checked before their
        parents, so the error names the innermost culprit."""
        env = {k: float(v) for k, v in self.params.items()}
        constant = constant_nodes(self.expr)
        values: dict = {}
        for n in postorder(self.expr):
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

    def _constant_error(self, n: Node, what: str, env: dict, why: str | None = None):
        values = ", ".join(f"{display_name(k)} = {render(num(v))}" for k, v in self.params.items()
                           if any(m.op == "param" and m.value == k for m in n.walk()))
        pos = n.pos or Pos(1, 1)
        lines = self.source.split("\n")
        src = lines[pos.line - 1] if pos.line <= len(lines) else None
        raise DslError(what + (f" at {values}" if values else "") + (f": {why}" if why else ""), self.path,
                       pos.line, pos.col, src,
                       f"a sub-expression of parameters and numbers only must be a finite {'real ' * bool(why)}number")

    def names(self) -> set[str]:
        """The built-ins the objective reads (r, pi, mu, A, pi_old, pi_rollout, seq_len)."""
        return {n.value for n in self.expr.walk() if n.op == "var"}

    def reads_rollout(self) -> bool:
        """Whether training needs the rollout engine's log-probs (μ is them, or π_rollout is named)."""
        return self.options["anchor"] == "rollout" or "pi_rollout" in self.names()

    def canonical(self) -> str:
        """Parameters, options, bindings and the objective, each inlined; if that would be
        longer than RENDER_LIMIT operations, bindings are referred to by name."""
        names = {v: k for k, v in self.bindings.items()} if tree_size(self.expr) > RENDER_LIMIT else None
        lines = [f"{display_name(k)} = {render(num(v))}" for k, v in self.params.items()]
        lines += [f"@{k} = {v}" for k, v in self.options.items()]
        lines += [f"{display_name(k)} = {render(v, names)}" for k, v in self.bindings.items()]
        last = display_name(names[self.expr]) if names and self.expr in names else render(self.expr, names)
        return "\n".join(lines + [last])

    def with_overrides(self, params: dict | None = None, options: dict | None = None,
                       where: str = "<overrides>") -> "Objective":
        """A copy with parameter/option values replaced; unknown names are located errors."""
        new_params, new_options = dict(self.params), dict(self.options)
        given = {}
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
                               text, f"its parameters are: {known}{_did_you_mean(name, self.params)}")
            new_params[name] = _finite_number(value, where, text, len(str(raw)) + 2)
        for key, value in (options or {}).items():
            _check_option(key, str(value), where, 1, 1, f"{key}={value}", len(key) + 2)
            new_options[key] = str(value)
        return Objective(self.name, self.path, self.source, self.expr, new_params, new_options,
                         self.bindings, self.description).check_constants()


def param_key(raw) -> str:
    """The parameter a user's spelling names, as in a file: NFKC, then ASCII (ϵ, ε, eps and
    epsilon are one name)."""
    return canonical_name(unicodedata.normalize("NFKC", str(raw)))


# ------------------------------------------------------------------ loading
def library() -> Path:
    """The shipped objectives: the objectives/ folder installed beside this package (in a
    checkout, the repository's). Found by path, never by import, so that no folder named
    objectives on sys.path, the current directory included, can stand in for it."""
    return Path(__file__).resolve().parent.parent / "objectives"


def shipped_names() -> list[str]:
    return sorted(p.name[:-4] for p in library().iterdir() if p.name.endswith(".dsl"))


def load(spec: str, params: dict | None = None, options: dict | None = None) -> Objective:
    """A path to a .dsl file or the name of a shipped objective (`drpo`)."""
    path = Path(spec)
    if path.is_file():
        data, shown = path.read_bytes(), str(spec)
    else:
        name = spec[:-4] if spec.endswith(".dsl") else spec
        res = library() / f"{name.replace('-', '_')}.dsl"
        if "/" in spec or not res.is_file():
            names = shipped_names()
            raise DslError(f"no objective file or shipped objective named '{spec}'", spec, 1, 1,
                           hint=f"shipped objectives: {', '.join(names)}{_did_you_mean(name, names)}")
        data, shown = res.read_bytes(), f"objectives/{res.name}"
    obj = parse_bytes(data, shown)
    return obj.with_overrides(params, options) if (params or options) else obj


def parse_bytes(data: bytes, path: str = "<string>") -> Objective:
    try:
        text = data.decode("utf-8-sig")   # a leading byte-order mark is not part of the text
    except UnicodeDecodeError as e:
        head = data[: e.start]
        line = head.count(b"\n") + 1
        col = len(head[head.rfind(b"\n") + 1:].decode("utf-8", "replace")) + 1
        raise DslError(f"the file is not UTF-8: byte 0x{data[e.start]:02x} cannot be decoded",
                       path, line, col, hint="save the objective file as UTF-8") from None
    return parse(text, path)


def parse(text: str, path: str = "<string>") -> Objective:
    return _Builder(text, path).build()


# ------------------------------------------------------------------ Lark
_PARSER = None


def _lark():
    global _PARSER
    if _PARSER is None:
        from lark import Lark
        grammar = resources.files("dsl").joinpath("grammar.lark").read_text(encoding="utf-8")
        # cache=True keeps the built LALR tables in the temp dir: 0.2 s saved per process.
        _PARSER = Lark(grammar, parser="lalr", lexer="contextual", propagate_positions=True,
                       maybe_placeholders=False, cache=True)
    return _PARSER


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


def _superscript(text: str) -> int:
    """⁻¹² -> -12."""
    return int(unicodedata.normalize("NFKC", text.replace("⁻", "-").replace("⁺", "")))


def _exact(n):
    """The exact rational value of a constant node whose every operation has an exact
    rational lowering (+ − × ÷ and integer powers), else None."""
    if n.op == "num":
        return n.value
    args = [_exact(a) for a in n.args]
    if None in args or n.op not in OPS or OPS[n.op].exact is None:
        return None
    return OPS[n.op].exact(*args)


def _not_real(op: str, args: list) -> str | None:
    """Why a constant has no real value, where real arithmetic has none (torch gives NaN)."""
    return OPS[op].not_real(*args) if OPS[op].not_real else None


def _safe_eval(n, env):
    try:
        return evaluate(n, env)
    except (ValueError, ZeroDivisionError, OverflowError, TypeError):
        return None


def _check_option(key, value, path, line, col, source_line, value_col):
    if key not in OPTIONS:
        raise DslError(f"unknown option '@{key}'", path, line, col, source_line,
                       f"options are: {', '.join('@' + k for k in OPTIONS)}{_did_you_mean('@' + key, ['@' + k for k in OPTIONS])}")
    if value not in OPTIONS[key]:
        raise DslError(f"'{value}' is not a value of @{key}", path, line, value_col, source_line,
                       f"@{key} is one of: {', '.join(OPTIONS[key])}")


class _Builder(Source):
    """Statements -> IR: parameters, bindings, options and the objective, each checked."""

    # ---- parse
    def build(self) -> Objective:
        from lark.exceptions import UnexpectedInput
        if not self.norm.strip() or all(not l.strip() or l.strip().startswith("#") for l in self.norm.split("\n")):
            raise self.error("the objective file is empty", Pos(1, 1),
                             "write the objective as an expression, e.g. r*A")
        try:
            tree = _lark().parse(self.norm + "\n")
            return self._statements(tree)
        except UnexpectedInput as e:
            raise self._syntax_error(e) from None
        except RecursionError:
            raise self.error("the expression is too long or too deeply nested to handle", Pos(1, 1),
                             "name sub-expressions with name = ... on their own lines") from None

    # ---- statements
    def _statements(self, tree) -> Objective:
        params, param_pos, bindings, options, objectives, seen = {}, {}, {}, {}, [], {}
        for st in tree.children:
            if st.data == "option":
                key_tok, val_tok = st.children
                kpos = self.pos(key_tok.start_pos)
                if key_tok.value in options:
                    raise self.error(f"option '@{key_tok.value}' is set twice", Pos(kpos.line, kpos.col - 1))
                _check_option(key_tok.value, val_tok.value, self.path, kpos.line, kpos.col - 1,
                              self.lines[kpos.line - 1], self.pos(val_tok.start_pos).col)
                options[key_tok.value] = val_tok.value
                continue
            if st.data == "objective":
                objectives.append(st.children[0])
                continue
            name_tok, expr = st.children
            name, npos = canonical_name(name_tok.value), self.pos(name_tok.start_pos)
            if name in BUILTINS:
                raise self.error(f"'{name_tok.value}' is a built-in ({BUILTINS[name]}) and cannot be rebound",
                                 npos, "choose another name")
            if name in OPTIONS:
                raise self.error(f"'{name_tok.value}' names an option; set it with @{name} = ...", npos)
            if name in seen:
                raise self.error(f"'{name_tok.value}' is already defined on line {seen[name].line}", npos,
                                 "each name is defined once; Unicode and ASCII spellings (δ, delta) are the same name")
            seen[name] = npos
            value = self._literal(expr)
            if value is not None:
                params[name] = self._param_value(value, expr)
                param_pos[name] = npos
            elif not any(t.data == "name" for t in expr.iter_subtrees()):
                params[name] = self._constant_value(expr)     # ε = 1/5: a parameter too
                param_pos[name] = npos
            else:
                bindings[name] = expr
        if not objectives:
            raise self.error("no objective: every line is a definition", Pos(1, 1),
                             "add one line that is a bare expression, e.g. r*A")
        if len(objectives) > 1:
            first = self._meta_pos(objectives[0])
            raise self.error(f"a second objective line (the first is on line {first.line})",
                             self._meta_pos(objectives[1]),
                             "exactly one line is the objective; name sub-expressions with name = ...")
        resolved: dict[str, Node] = {}
        expr = self._expr(objectives[0], params, bindings, resolved, ())
        self._check_kind(expr, "num")
        self._check_policy(expr, self._meta_pos(objectives[0]))
        for k, v in OPTION_DEFAULTS.items():
            options.setdefault(k, v)
        order = {k: seen[k] for k in resolved}
        used = {k: resolved[k] for k in sorted(order, key=lambda k: (order[k].line, order[k].col))}
        stem = Path(self.path).name
        return Objective(stem[:-4] if stem.endswith(".dsl") else stem, self.path, self.source,
                         expr, params, {k: options[k] for k in OPTIONS}, used, self._description()).check_constants()

    def _description(self) -> str:
        out = []
        for line in self.lines:
            s = line.strip()
            if not s.startswith("#"):
                break
            out.append(s.lstrip("#").strip())
        return "\n".join(out)

    def _meta_pos(self, tree) -> Pos:
        if hasattr(tree, "meta") and not tree.meta.empty:
            return self.pos(tree.meta.start_pos)
        return self.pos(tree.start_pos)

    def _literal(self, expr):
        """A parameter is a bare (optionally negated) number literal."""
        sign = 1
        while hasattr(expr, "data") and expr.data in ("neg", "pos"):
            sign *= -1 if expr.data == "neg" else 1
            expr = [c for c in expr.children if hasattr(c, "data") or c.type == "NUMBER"][-1]
        if hasattr(expr, "data") and expr.data == "number":
            return sign, expr.children[0]
        return None

    def _number(self, tok) -> Fraction:
        # float() first: Fraction("1e99999999") would build a 10^99999999-digit integer
        if not math.isfinite(float(tok.value)):
            raise self.error(f"the number '{tok.value}' is not finite in double precision",
                             self.pos(tok.start_pos), "write a number below 1.8e308")
        return Fraction(tok.value)

    def _param_value(self, value, expr) -> Fraction:
        sign, tok = value
        if not math.isfinite(float(tok.value)):
            raise self.error(f"parameter value '{tok.value}' is not a finite number",
                             self.pos(tok.start_pos), "write a decimal number such as 0.2, .5 or 1e-3")
        return sign * Fraction(tok.value)

    def _constant_value(self, expr) -> Fraction:
        """A parameter's default written with numbers and operators only (1/5, 2^-3, sqrt(2)/10):
        exact where the arithmetic is rational, else the double-precision value."""
        node = self._expr(expr, {}, {}, {}, ())
        self._check_kind(node, "num")
        value = _exact(node)
        if value is None:
            f = _safe_eval(node, {})
            value = Fraction(repr(f)) if isinstance(f, float) and math.isfinite(f) else None
        if value is None:
            raise self.error(f"parameter value '{render(node)}' is not a finite number", self._meta_pos(expr),
                             "a parameter's default is a number, or numbers and operators only, e.g. 1/5")
        return value

    # ---- expressions: Lark tree -> IR, resolving names and checking arity on the way
    def _expr(self, t, params, bindings, resolved, stack) -> Node:
        pos = self._meta_pos(t)
        kids = [c for c in t.children if hasattr(c, "data")]
        rec = lambda c: self._expr(c, params, bindings, resolved, stack)
        d = t.data
        if d == "number":
            return Node("num", value=self._number(t.children[0]), pos=pos)
        if d == "name":
            return self._name(t.children[0], params, bindings, resolved, stack)
        if d == "call":
            return self._call(t, [rec(c) for c in kids], params, bindings)
        if d == "implicit":
            return self._implicit(t, rec)
        if d == "sup":
            return Node("pow", (rec(kids[0]), num(_superscript(t.children[1].value))), pos=pos)
        if d == "pos":
            return rec(kids[0])
        if d == "abs":
            return Node("abs", (rec(kids[0]),), pos=pos)
        if d == "indicator":
            return Node("ind", (rec(kids[0]),), pos=pos)
        op = d.rstrip("_")
        return Node(op, tuple(rec(c) for c in kids), pos=pos)

    def _name(self, tok, params, bindings, resolved, stack) -> Node:
        name, pos = canonical_name(tok.value), self.pos(tok.start_pos)
        if name in BUILTINS:
            return Node("var", value=name, pos=pos)
        if name in params:
            return Node("param", value=name, pos=pos)
        if name in bindings:
            if name in stack:
                raise self.error(f"'{tok.value}' is defined in terms of itself", pos)
            if name not in resolved:
                resolved[name] = self._expr(bindings[name], params, bindings, resolved, stack + (name,))
            return resolved[name]
        if name in FUNCTIONS:
            raise self.error(f"'{tok.value}' is a function; call it as {tok.value}(...)", pos)
        known = list(BUILTINS) + list(params) + list(bindings)
        raise self.error(f"unknown name '{tok.value}'", pos,
                         f"declare it as a parameter on its own line, e.g. '{tok.value} = 0.1'"
                         f"{_lookalike(tok.value, [display_name(k) for k in known]) or _did_you_mean(name, known)}")

    def _call(self, t, args, params, bindings) -> Node:
        tok = t.children[0]
        raw, name, pos = tok.value, canonical_name(tok.value), self.pos(tok.start_pos)
        if name not in FUNCTIONS:
            if name in BATCH_WIDE:
                raise self.error(f"'{raw}' would reduce over the whole batch; only reductions over one "
                                 "response's tokens are in the language", pos,
                                 "a batch statistic changes with how the batch is split into micro-batches "
                                 "and ranks; use seq_mean, seq_sum, seq_max, seq_min or seq_len, or compute "
                                 "it into the advantages")
            if name in BUILTINS or name in params or name in bindings:
                raise self.error(f"'{raw}' is not a function", pos,
                                 f"to multiply, write {raw}*(...)")
            raise self.error(f"unknown function '{raw}'", pos,
                             f"functions are: {', '.join(FUNCTIONS)}{_did_you_mean(name, FUNCTIONS)}")
        lo, hi = FUNCTIONS[name]
        if len(args) < lo or (hi is not None and len(args) > hi):
            want = f"{lo}" if lo == hi else (f"at least {lo}" if hi is None else f"{lo} to {hi}")
            raise self.error(f"{name}() takes {want} argument{'s' if want != '1' else ''}, got {len(args)}",
                             pos, f"write {OPS[name].signature}")
        return Node(name, tuple(args), pos=pos)

    def _implicit(self, t, rec) -> Node:
        num_tok = t.children[0]
        rest = [c for c in t.children[1:]]
        operand = rest[0]
        op_pos = self._meta_pos(operand) if hasattr(operand, "data") else self.pos(operand.start_pos)
        if self.norm[num_tok.end_pos].isspace():
            raise self.error("implicit multiplication needs the number directly before its factor",
                             op_pos, f"write {num_tok.value}*... or remove the space")
        base = rec(operand)
        tail = rest[1:]
        if tail and getattr(tail[0], "type", "") == "SUPERSCRIPT":
            base = Node("pow", (base, num(_superscript(tail[0].value))), pos=op_pos)
        elif tail:
            base = Node("pow", (base, rec(tail[-1])), pos=op_pos)
        return Node("mul", (Node("num", value=self._number(num_tok), pos=self.pos(num_tok.start_pos)), base),
                    pos=self.pos(num_tok.start_pos))

    # ---- semantic checks
    def _check_kind(self, root: Node, want: str):
        seen, stack = set(), [(root, want)]
        while stack:            # each (node, expected kind) once, without recursion
            n, want = stack.pop()
            if (n, want) in seen:
                continue
            seen.add((n, want))
            kind = "num" if n.op in ("num", "var", "param") else OPS[n.op].kind
            if kind != want:
                if want == "num":
                    raise self.error(f"the condition '{render(n)}' is used as a number", n.pos,
                                     f"write [{render(n)}] for its 0/1 indicator")
                raise self.error(f"expected a condition, found the number '{render(n)}'", n.pos,
                                 "conditions use < <= > >= == != and, or, not; e.g. [r > 1]")
            if n.op in OPS:
                stack.extend((a, OPS[n.op].args_kind) for a in n.args)

    def _check_policy(self, expr: Node, pos: Pos):
        live = set()    # r or π reachable through something with a nonzero derivative
        for n in postorder(expr):
            if (n.op == "var" and n.value in ("r", "pi")) or (
                    any(a in live for a in n.args) and not passes_no_gradient(n.op)):
                live.add(n)
        if expr not in live:
            raise self.error("the objective does not depend on the policy", pos,
                             "use r or π outside sg(...), [...] and sign(...); otherwise its gradient is zero")
