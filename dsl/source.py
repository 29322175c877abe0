"""The text of an objective file as Lark sees it and as its author wrote it: Unicode
normalization that keeps every position in the original text, and Lark's syntax errors
turned into located messages (ambiguous implicit products, unclosed brackets, invisible
characters, look-alike letters)."""
from __future__ import annotations

import difflib
import unicodedata

from dsl.errors import DslError
from dsl.ir import Pos
from dsl.names import display_name

BAR_OPEN, BAR_CLOSE = "\ue000", "\ue001"
# dashes a word processor puts where minus was meant (U+2212 MINUS SIGN is read as '-')
DASHES = {"–": "an en dash", "—": "an em dash", "‒": "a figure dash", "‐": "a hyphen", "‑": "a non-breaking hyphen"}
SUPERSCRIPTS = "⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻"       # kept as they are: NFKC would turn x⁻¹ into x−1
_OPERAND_END = set("_)]." + BAR_CLOSE + SUPERSCRIPTS)


_TOKEN_NAMES = {
    "NUMBER": "a number", "NAME": "a name", "OPTVALUE": "an option value", "LPAR": "'('",
    "RPAR": "')'", "LSQB": "'['", "RSQB": "']'", "COMMA": "','", "EQUAL": "'='", "PLUS": "'+'",
    "MINUS": "'-'", "TIMES": "'*'", "SLASH": "'/'", "POW": "'^'", "BAR_OPEN": "'|'",
    "BAR_CLOSE": "'|'", "_NL": "end of line", "$END": "end of file", "AT": "'@'",
    "SUPERSCRIPT": "a superscript exponent", "LT": "'<'", "LE": "'<='", "GT": "'>'", "GE": "'>='", "EQ": "'=='",
    "NE": "'!='", "AND": "'and'", "OR": "'or'", "NOT": "'not'",
}
_OPERAND_START = {"NAME", "NUMBER", "LPAR", "BAR_OPEN", "LSQB"}


# Cyrillic and Greek letters drawn like Latin ones: a name holding one is a different name
_LOOKALIKES = str.maketrans("аеорсухіјѕԁԛԝАВЕКМНОРСТХοΟΑΒΕΖΗΙΚΜΝΡΤΥΧ", "aeopcyxijsdqwABEKMHOPCTXoOABEZHIKMNPTYX")


def lookalike(name: str, known: list[str]) -> str:
    """A hint naming the look-alike letters in `name` or in the known name it is drawn like."""
    def letters(*names):
        odd = dict.fromkeys(c for n in names for c in n if c.translate(_LOOKALIKES) != c)
        return ", ".join(f"'{c}' is U+{ord(c):04X} {unicodedata.name(c)}, not Latin '{c.translate(_LOOKALIKES)}'"
                         for c in odd)
    twin = next((k for k in known if k != name and k.translate(_LOOKALIKES) == name.translate(_LOOKALIKES)), None)
    if twin is not None:
        return f"; '{name}' and the defined '{twin}' look alike but are different names: {letters(name, twin)}"
    return f"; {letters(name)}" if name.translate(_LOOKALIKES) != name else ""


def edits(a: str, b: str) -> int:
    """The optimal string alignment distance: insertions, deletions, substitutions and swaps of two
    neighbouring letters, each one edit (dpro is one swap from drpo, as dro is one deletion)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def closest(name: str, candidates) -> str | None:
    """The candidate itself, or one edit away (edits), ties going to the one with the same letters
    (a swap keeps them) and then to difflib's likeness; else difflib's closest, or None."""
    candidates = list(candidates)
    if name in candidates:
        return name
    near = [c for c in candidates if edits(name, c) == 1]
    if near:
        letters = lambda c: len(set(c) ^ set(name))       # noqa: E731
        return min(near, key=lambda c: (letters(c), -difflib.SequenceMatcher(None, name, c).ratio(), c))
    close = difflib.get_close_matches(name, candidates, n=1)
    return close[0] if close else None


def did_you_mean(name, candidates) -> str:
    close = closest(name, candidates)
    return f"; did you mean '{display_name(close)}'?" if close is not None else ""


class Source:
    """Normalized text (what Lark parses) with a map back to the original's positions."""

    def __init__(self, text: str, path: str):
        text = text.replace("\r\n", "\n").replace("\r", "\n")     # CRLF and CR-only files too
        self.source, self.path = text, path
        self.lines = text.split("\n")
        self.norm, self.origin = self._normalize(text)

    # ---- positions: Lark sees normalized text, errors point into the original
    def _normalize(self, text):
        out, origin, depth, prev = [], [], 0, ""
        for i, ch in enumerate(text):
            normal = unicodedata.normalize("NFKC", ch)
            if normal == "|":      # | and its full-width and other forms
                # A bar after an operand closes an open |...|; anywhere else it opens one.
                if (prev in _OPERAND_END or prev.isalnum()) and depth:
                    ch, depth = BAR_CLOSE, depth - 1
                else:
                    ch, depth = BAR_OPEN, depth + 1
                piece = ch
            elif ch in SUPERSCRIPTS:
                piece = ch
            else:
                piece = normal
            if ch == "\n":
                depth = 0
            out.append(piece)
            origin.extend([i] * len(piece))
            if not piece.isspace():
                prev = piece[-1]
        origin.append(len(text))
        return "".join(out), origin

    def pos(self, norm_offset: int) -> Pos:
        i = self.origin[min(norm_offset, len(self.origin) - 1)]
        line = self.source.count("\n", 0, i) + 1
        return Pos(line, i - (self.source.rfind("\n", 0, i) + 1) + 1)

    def meta_pos(self, tree) -> Pos:
        """Where a Lark subtree (or token) starts in the original text."""
        if hasattr(tree, "meta") and not tree.meta.empty:
            return self.pos(tree.meta.start_pos)
        return self.pos(tree.start_pos)

    def error(self, msg, pos: Pos, hint=None):
        src = self.lines[pos.line - 1].rstrip("\r") if pos.line <= len(self.lines) else ""
        return DslError(msg, self.path, pos.line, pos.col, src, hint)

    def _syntax_error(self, e):
        from lark.exceptions import UnexpectedCharacters
        offset = min(e.pos_in_stream if e.pos_in_stream is not None else len(self.norm), len(self.norm))
        pos = self.pos(offset)
        if isinstance(e, UnexpectedCharacters):
            ch = self.norm[offset]
            if not ch.isprintable():
                return self.error(f"unexpected invisible character U+{ord(ch):04X} {unicodedata.name(ch, '')}".rstrip(),
                                  pos, "delete it (it often comes with text copied from a web page or a word processor)")
            if ch in DASHES:
                return self.error(f"unexpected character '{ch}' ({DASHES[ch]})", pos,
                                  "write '-' (the ASCII hyphen-minus) for minus")
            if ch == ";":
                rest = self.norm[offset + 1:].split("\n", 1)[0].strip()
                return self.error("unexpected ';'", pos, "a statement ends at the end of its line: delete the ';'"
                                  if not rest or rest.startswith("#") else "write each statement on its own line")
            if ch in SUPERSCRIPTS:
                return self.error(f"unexpected character '{ch}'", pos,
                                  "a superscript exponent is digits with an optional sign before them, e.g. x⁻¹ or x²")
            return self.error(f"unexpected character '{ch}'", pos,
                              "operators are + - * / ^, comparisons < <= > >= == !=, and/or/not")
        tok = e.token
        before = self.norm[:offset].rstrip(" \t")
        if tok.type in _OPERAND_START and before and (before[-1].isalnum() or before[-1] in _OPERAND_END):
            return self.error(
                "ambiguous implicit multiplication", pos,
                "implicit multiplication is allowed only right after a number (2δ, 2(r-1), 2|x|) "
                "and never in a divisor; write '*' explicitly, e.g. a/(b*c) or a/b*c, |a|*|b|")
        after = self.norm[tok.end_pos:tok.end_pos + 1] if tok.end_pos is not None else ""
        if tok.value == "," and before[-1:].isdigit() and after.isdigit():
            whole = before[len(before.rstrip("0123456789")):]
            frac = self.norm[tok.end_pos:len(self.norm) - len(self.norm[tok.end_pos:].lstrip("0123456789"))]
            return self.error("unexpected ',' in a number", pos,
                              f"a decimal comma: write {whole}.{frac}, with a decimal point")
        expected = sorted({_TOKEN_NAMES.get(t, t) for t in getattr(e, "expected", ()) or ()})
        found = "end of line" if tok.type in ("_NL", "$END") else f"'{self._orig_text(tok)}'"
        hint = self._unclosed(offset) or (f"expected {', '.join(expected[:8])}" if expected else None)
        return self.error(f"unexpected {found}", pos, hint)

    def _orig_text(self, tok):
        start = self.origin[tok.start_pos]
        return self.source[start:self.origin[min(tok.end_pos, len(self.origin) - 1)]] or tok.value

    def _unclosed(self, offset):
        line_start = self.norm.rfind("\n", 0, offset) + 1
        stack = []
        for i in range(line_start, offset):
            c = self.norm[i]
            if c in "([" + BAR_OPEN:
                stack.append(i)
            elif c in ")]" + BAR_CLOSE and stack:
                stack.pop()
        if stack:
            p = self.pos(stack[-1])
            ch = self.source[self.origin[stack[-1]]]
            return f"the '{ch}' at column {p.col} is never closed"
        return None
