"""Text -> IR. Lark parses the normalized text (dsl.source); this module loads files, reads
each statement (parameters, bindings, options, the objective), builds the IR itself through
dsl.expressions (user text never reaches sympify or eval) and turns every problem into a
located DslError."""
from __future__ import annotations

import math
import os
import warnings
from fractions import Fraction
from importlib import resources
from pathlib import Path

from dsl.errors import DslError, DslWarning
from dsl.expressions import Expressions, check_kind, check_policy
from dsl import library
from dsl.controls import STEP, STEP_MEANING, check_rule
from dsl.ir import Pos
from dsl.names import BUILTINS, canonical_name, display_name
from dsl.objective import OPTION_DEFAULTS, OPTIONS, Objective, check_option
from dsl.operations import OPS, REDUCTIONS
from dsl.printing import render
from dsl.source import Source, closest, edits
from dsl.vocabulary import check_vocabulary
from dsl.walks import evaluate


# ------------------------------------------------------------------ loading
def shipped_names() -> list[str]:
    return sorted(p.name[:-4] for p in library.folder().iterdir() if p.name.endswith(".dsl"))


def parse_spec(text: str) -> tuple[str, dict[str, str]]:
    """`name` or `name:k=v,k=v` (drpo-analyze, drpo-lab) -> (name, {k: v}). An existing file is
    itself, colon or not."""
    if ":" not in text or Path(text).is_file():
        return text, {}
    name, _, rest = text.partition(":")
    params, col = {}, len(name) + 2
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not item:        # drpo:delta=0.2, (a trailing comma) says nothing more
            col += 1
            continue
        if not eq or not key.strip() or not value.strip():
            raise DslError(f"expected NAME=VALUE after '{name}:', got '{item}'", "<command line>", 1, col, text,
                           f"write {name}:delta=0.2 or {name}:delta=0.2,eps=0.1")
        if key.strip() in params:
            raise DslError(f"'{key.strip()}' is set twice", "<command line>", 1, col, text, "keep one of them")
        params[key.strip()] = value.strip()
        col += len(item) + 1
    return name, params


def _near(path: Path) -> str:
    """For a missing file: the .dsl files beside where it was looked for, the closest names first
    (a few edits away), and a shipped objective of a close name."""
    folder = path.parent
    if not folder.is_dir():
        return f"no such directory: {folder}"
    stem = path.name[:-4] if path.name.endswith(".dsl") else path.name
    files = sorted(p.name for p in folder.glob("*.dsl"))
    near = sorted((edits(stem, f[:-4]), f) for f in files if edits(stem, f[:-4]) <= max(2, len(stem) // 3))
    where = "this directory" if str(folder) == "." else str(folder)
    said = (f".dsl files in {where} with a close name: {', '.join(f for _, f in near[:5])}" if near else
            f"no .dsl file in {where} has a close name" + (f" (it holds {len(files)})" if files else ""))
    shipped = closest(stem, shipped_names())
    if shipped is not None and edits(stem, shipped) <= 2:
        said += f"; the shipped objective '{shipped}' is named by its name alone"
    return said


def load(spec: str, params: dict | None = None, options: dict | None = None) -> Objective:
    """A path to a .dsl file or the name of a shipped objective (`drpo`)."""
    path = Path(spec)
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.dsl"))
        raise DslError(f"'{spec}' is a directory, not an objective file", spec, 1, 1,
                       hint=f"name a .dsl file in it ({', '.join(inside[:8])})" if inside else "it holds no .dsl file")
    if path.is_file():
        data, shown = path.read_bytes(), str(spec)
    else:
        name = spec[:-4] if spec.endswith(".dsl") else spec
        res = library.folder() / f"{name.replace('-', '_')}.dsl"
        if "/" in spec or os.sep in spec or (spec.endswith(".dsl") and not res.is_file()):
            raise DslError(f"file not found: '{spec}'", spec, 1, 1, hint=_near(path))
        if not res.is_file():
            names = shipped_names()
            close = closest(name, names)    # a close name is the hint; the whole list only without one
            hint = (f"did you mean '{close}'? (drpo-analyze --list lists the {len(names)} shipped objectives)" if close
                    else f"shipped objectives: {', '.join(names)}")
            raise DslError(f"no objective file or shipped objective named '{spec}'", spec, 1, 1, hint=hint)
        data, shown = res.read_bytes(), library.shown(res)
    obj = parse_bytes(data, shown)
    return obj.with_overrides(params, options) if (params or options) else obj


def _warn_unused(src, seen: dict, params: dict, read: set) -> None:
    """A definition the objective never reads is likely a typo where it is read."""
    for name in sorted(seen.keys() - read, key=lambda k: (seen[k].line, seen[k].col)):
        what = "parameter" if name in params else "definition"
        warnings.warn(DslWarning(src.error(f"{what} '{display_name(name)}' is never used by the objective", seen[name],
                                           "a typo where it is used? otherwise delete the line").render("warning")),
                      stacklevel=5)


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



def _exact(n):
    """The exact rational value of a constant node whose every operation has an exact
    rational lowering (+ − × ÷ and integer powers), else None."""
    if n.op == "num":
        return n.value
    args = [_exact(a) for a in n.args]
    if None in args or n.op not in OPS or OPS[n.op].exact is None:
        return None
    return OPS[n.op].exact(*args)


def _safe_eval(n, env):
    try:
        return evaluate(n, env)
    except (ValueError, ZeroDivisionError, OverflowError, TypeError):
        return None


class _Builder(Source):
    """Statements -> Objective: parameters, bindings, options and the objective, each checked."""

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

    def _statements(self, tree) -> Objective:
        params, bindings, options, objectives, seen, updates = {}, {}, {}, [], {}, []
        for st in tree.children:
            if st.data == "option":
                self._option(st, options)
            elif st.data == "update":
                updates.append(st)
            elif st.data == "objective":
                objectives.append(st.children[0])
            else:
                self._definition(st, params, bindings, seen)
        if not objectives:
            raise self.error("no objective: every line is a definition", Pos(1, 1),
                             "add one line that is a bare expression, e.g. r*A")
        if len(objectives) > 1:
            first = self.meta_pos(objectives[0])
            raise self.error(f"a second objective line (the first is on line {first.line})",
                             self.meta_pos(objectives[1]),
                             "exactly one line is the objective; name sub-expressions with name = ...")
        exprs = Expressions(self, params, bindings)
        expr = exprs.build(objectives[0])
        check_kind(self, expr, "num")
        check_vocabulary(self, expr)
        check_policy(self, expr, self.meta_pos(objectives[0]))
        controls = _controls(self, updates, exprs, params)
        declared, options = frozenset(options), {**OPTION_DEFAULTS, **options}     # (the file's, then the defaults)
        read = {n.value for root in [expr, *(c.rule for c in controls.values())] for n in root.walk() if n.op == "param"}
        _warn_unused(self, seen, params, read | set(exprs.resolved))
        order = {k: seen[k] for k in exprs.resolved}
        used = {k: exprs.resolved[k] for k in sorted(order, key=lambda k: (order[k].line, order[k].col))}
        stem = Path(self.path).name
        return Objective(stem[:-4] if stem.endswith(".dsl") else stem, self.path, self.source,
                         expr, params, {k: options[k] for k in OPTIONS}, used, _description(self.lines),
                         declared, controls).check_constants()

    def _option(self, st, options):
        key_tok, val_tok = st.children
        kpos = self.pos(key_tok.start_pos)
        if key_tok.value in options:
            raise self.error(f"option '@{key_tok.value}' is set twice", Pos(kpos.line, kpos.col - 1))
        check_option(key_tok.value, val_tok.value, self.path, kpos.line, kpos.col - 1,
                     self.lines[kpos.line - 1], self.pos(val_tok.start_pos).col)
        options[key_tok.value] = val_tok.value

    def _definition(self, st, params, bindings, seen):
        """name = a number (a parameter), numbers and operators (a parameter too), or an
        expression of names (a binding)."""
        name_tok, expr = st.children
        name, npos = canonical_name(name_tok.value), self.pos(name_tok.start_pos)
        if name in BUILTINS or name == STEP:
            raise self.error(f"'{name_tok.value}' is a built-in ({BUILTINS.get(name, STEP_MEANING)}) and cannot be "
                             "rebound", npos, "choose another name")
        if name in OPTIONS:
            raise self.error(f"'{name_tok.value}' names an option; set it with @{name} = ...", npos)
        if name in seen:
            raise self.error(f"'{name_tok.value}' is already defined on line {seen[name].line}", npos,
                             "each name is defined once; Unicode and ASCII spellings (δ, delta) are the same name")
        seen[name] = npos
        value = self._literal(expr)
        if value is not None:
            params[name] = self._param_value(value)
        elif not any(t.data == "name" or (t.data == "call" and canonical_name(t.children[0].value) in REDUCTIONS)
                     for t in expr.iter_subtrees()):
            params[name] = self._constant_value(expr)     # ε = 1/5: a parameter too (t = prefix_sum(1) is not)
        else:
            bindings[name] = expr

    def _literal(self, expr):
        """A parameter is a bare (optionally negated) number literal."""
        sign = 1
        while hasattr(expr, "data") and expr.data in ("neg", "pos"):
            sign *= -1 if expr.data == "neg" else 1
            expr = [c for c in expr.children if hasattr(c, "data") or c.type == "NUMBER"][-1]
        if hasattr(expr, "data") and expr.data == "number":
            return sign, expr.children[0]
        return None

    def _param_value(self, value) -> Fraction:
        sign, tok = value
        if not math.isfinite(float(tok.value)):
            raise self.error(f"parameter value '{tok.value}' is not a finite number",
                             self.pos(tok.start_pos), "write a decimal number such as 0.2, .5 or 1e-3")
        return sign * Fraction(tok.value)

    def _constant_value(self, expr) -> Fraction:
        """A parameter's default written with numbers and operators only (1/5, 2^-3, sqrt(2)/10):
        exact where the arithmetic is rational, else the double-precision value."""
        node = Expressions(self, {}, {}).build(expr)
        check_kind(self, node, "num")
        value = _exact(node)
        if value is None:
            f = _safe_eval(node, {})
            value = Fraction(repr(f)) if isinstance(f, float) and math.isfinite(f) else None
        if value is None:
            raise self.error(f"parameter value '{render(node)}' is not a finite number", self.meta_pos(expr),
                             "a parameter's default is a number, or numbers and operators only, e.g. 1/5")
        return value


def _controls(src: Source, updates, exprs: Expressions, params: dict) -> dict:
    """Each `name ← rule in [low, high]` line as a Control (dsl.controls), in the file's order."""
    out, names = {}, {canonical_name(st.children[0].value): st.children[0] for st in updates}
    for st in updates:
        tok, rule_tree, rest = st.children[0], st.children[2], st.children[3:]
        name, pos = canonical_name(tok.value), src.pos(tok.start_pos)
        if name in out:
            raise src.error(f"'{tok.value}' has a second update rule (the first is on line {out[name].pos.line})",
                             pos, "a controlled parameter has one rule")
        if name not in params or name == STEP:
            what = ("a built-in" if name in BUILTINS or name == STEP else "a definition, not a parameter"
                    if name in exprs.bindings else "not defined")
            raise src.error(f"'{tok.value}' is {what}: only a parameter is controlled", pos,
                             "choose a name of your own" if what == "a built-in" else
                             f"define its value at the first step on its own line, e.g. '{tok.value} = 0.05'")
        rule = exprs.build(rule_tree)
        check_kind(src, rule, "num")
        bounds = tuple(exprs.build(b) for b in rest[1:]) if rest else None
        for b in bounds or ():
            check_kind(src, b, "num")
        out[name] = check_rule(src, name, rule, bounds, params, pos, controlled=set(names))
    return out


def _description(lines) -> str:
    out = []
    for line in lines:
        s = line.strip()
        if not s.startswith("#"):
            break
        out.append(s.lstrip("#").strip())
    return "\n".join(out)
