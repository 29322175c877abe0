"""The language's one exception type, rendered compiler-style with a caret."""
from __future__ import annotations


class DslError(Exception):
    """A located error: path:line:col: error: message, the source line, a caret, a hint."""

    def __init__(self, message: str, path: str = "<string>", line: int = 1, col: int = 1,
                 source_line: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.message, self.path, self.line, self.col = message, path, line, col
        self.source_line, self.hint = source_line, hint

    def render(self, kind: str = "error") -> str:
        out = [f"{self.path}:{self.line}:{self.col}: {kind}: {self.message}"]
        if self.source_line is not None:
            # invisible characters (zero-width space, a stray byte-order mark) are shown as �;
            # tabs stay tabs under the line too, so the caret lands under its column
            shown = "".join(c if c == "\t" or c.isprintable() else "\ufffd" for c in self.source_line)
            out.append("    " + shown)
            out.append("    " + "".join("\t" if c == "\t" else " " for c in shown[:self.col - 1]) + "^")
        if self.hint:
            out.append(f"hint: {self.hint}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()


class DslWarning(UserWarning):
    """A located warning (a definition the objective never reads), its text rendered as an error's;
    drpo-analyze prints it to stderr, a library user gets it from the warnings module."""
