"""The analysis result, a declared structure: each field is declared once, with its JSON name,
the report line that shows it and the claim that is its evidence, and analysis.present.report's to_json and
report iterate these declarations. A field the JSON has but the analysis does not compute (the
symbols, the formulas as text) is derived from the others when the result is built."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

from openrlhf_drpo.analysis.present.alert_text import alert_text
from openrlhf_drpo.analysis.mathtext import math_text


def declared(json=None, line=None, evidence=None, encode=None, derive=None, optional=False):
    """A field of the result. json: its name in the JSON (None: not in it), where its order in
    the class is its order in the JSON; line: the name of the report line that shows it
    (openrlhf_drpo.analysis.present.report.LINES); evidence: the key in `claims` of what the claim it makes rests on;
    encode: its JSON form where that is not the value itself; derive: how a field the
    analysis does not compute follows from the others; optional: absent from the JSON (and its
    line from the report) where it is None, as a construct the objective does not use."""
    meta = {"json": json, "line": line, "evidence": evidence, "encode": encode, "derive": derive,
            "optional": optional}
    return field(default=None, init=derive is None, repr=False, compare=False, metadata=meta)


# ------------------------------------------------------------------ JSON forms: SymPy strings that
# sympify reads back over r, mu, A and the parameters
def _sympy(e) -> str:
    import sympy as sp
    return sp.sstr(e)


def _cases(cases) -> list:
    return [{"advantage": c["advantage"], "direction": c["direction"], "weight": _sympy(c["weight"])} for c in cases]


def _boundary(boundary) -> dict:
    return {adv: {"r": [_sympy(e) for e in b["r"]], "pi": [_sympy(e) for e in b["pi"]], "kind": b["kind"],
                  "reachable": b["reachable"], "numeric": b["numeric"], "where": b["where"]}
            for adv, b in boundary.items()}


def _floats(values) -> list:
    return [None if v is None else float(v) for v in values]


def _texts(alerts) -> list[str]:
    return [alert_text(a) for a in alerts]


def _entropy(channel) -> dict:
    return {"w_H": None if channel["w_H"] is None else _sympy(channel["w_H"]), "check": channel["check"]}


def _advantage(adv) -> dict:
    held = adv["held"] or {}
    value = held.get("value")
    return {"name": adv["name"], "expression": adv["expression"], "group": adv["group"],
            "held": None if value is None else _sympy(value), "eps": held.get("eps", []), "text": adv["text"]}


def _reference(channel) -> dict:
    return {"terms": channel["terms"], "own_channel": channel["own"],
            "grad_log_pi": None if channel["grad"] is None else _sympy(channel["grad"]), "check": channel["check"]}


def _formulas(res) -> dict:
    """The same formulas as the report prints them (readable math, never SymPy's calls)."""
    out = {"weight": None if res.weight is None else math_text(res.weight, weight=True),
           "cases": [math_text(c["weight"], weight=True) for c in res.cases],
           "boundary": {adv: {"r": [math_text(e) for e in b["r"]], "pi": [math_text(e) for e in b["pi"]]}
                        for adv, b in res.boundary.items()}}
    for key, channel, formula in (("w_H", res.entropy, "w_H"), ("reference", res.reference, "grad")):
        if channel is not None and channel[formula] is not None:
            out[key] = math_text(channel[formula], weight=True)
    return out


RENDER: dict = {}     # "text", "json", "markdown", "html" -> function(Analysis) -> its form, from analysis.present.notebook
REPR_WIDTH = 120      # repr(result): one line


@dataclass
class Analysis:
    """What drpo-analyze derives for one objective (openrlhf_drpo.analysis.analyze). In a notebook
    it renders as its report with the plot; report() (and print) is drpo-analyze's text, to_json()
    its --json; repr is one short line."""
    name: str = declared(json="name", line="title")
    path: str = declared()
    description: str = declared()
    source: str = declared()       # the objective's text: the report abbreviates a long objective to it
    params: dict = declared(json="params", line="params")
    options: dict = declared(json="options", line="options")
    # names SymPy would read as its own (E, I, N, S, O, Q, beta, gamma, pi, ...) read back as
    # symbols with sympy.sympify(text, locals={n: sympy.Symbol(n) for n in symbols})
    # (q = π_ref/π too, where the reference terms' formula reads it)
    symbols: list = declared(json="symbols",
                             derive=lambda res: ["r", "mu", "A", *res.params, *(["q"] if res.reference else [])])
    scope: dict = declared(json="scope", line="scope")
    objective: str = declared(json="objective", line="objective")
    # token | response | group | batch, the widest a gradient reaches and what a loss call must hold
    # whole (dsl.levels): a chunked or fused host can run only some objectives
    locality: dict = declared(json="locality", line="locality")
    # an objective with memory: its controls analysed over their bounds and its schedule over the steps,
    # the claims that hold at every point and those that change (analysis.memory)
    memory: dict = declared(json="memory", line="memory", optional=True)
    # the objective's own advantage Â, where it builds one from A: w is against it (analysis.batch.advantage)
    advantage: dict = declared(json="advantage", line="advantage", encode=_advantage, optional=True)
    weight: object = declared(json="weight", line="weight", encode=_sympy)
    # the entropy's own gradient channel w_H = ∂ℓ/∂H, where the objective reads H (analysis.symbolic.channels)
    entropy: dict = declared(json="entropy", line="entropy", encode=_entropy, optional=True)
    # the terms that read π_ref and their part of w·r·A, ∂ℓ_ref/∂log π in q = π_ref/π (analysis.symbolic.channels)
    reference: dict = declared(json="reference", line="reference", encode=_reference, optional=True)
    cases: list = declared(json="cases", line="cases", encode=_cases)
    boundary: dict = declared(json="boundary", line="boundary", evidence="boundary", encode=_boundary)
    reachable: dict = declared(json="reachable", evidence="reachable")
    # per claim: "proven" (symbolic), "found" (located points), "unconfirmed" (the evidence given)
    claims: dict = declared(json="claims")
    weight_range: list = declared(json="weight_range", line="range", evidence="bounded", encode=_floats)
    bounded: bool = declared(json="bounded", evidence="bounded")
    smooth: bool = declared(json="smooth", line="smooth", evidence="smooth")
    geometry: str = declared(json="geometry", line="geometry")
    on_policy: dict = declared(json="on_policy", line="on_policy")
    arbiter: dict = declared(json="arbiter", line="arbiter")
    warnings: list = declared(json="warnings", line="warnings", encode=_texts)    # analysis.alerts' records
    self_check: dict = declared(json="self_check", line="self_check")
    admissibility: dict = declared(json="admissibility", line="admissibility")
    notes: list = declared(json="notes", line="notes")
    # the situations that change the gradient, derived from the objective's constructs, each with its
    # claim and the compiled loss's word (analysis.batch.scenarios); `scenario`: the one analysed, if chosen
    scenarios: dict = declared(json="scenarios", line="scenarios", optional=True)
    scenario: str = declared(json="scenario", optional=True)
    hang_guard: dict = declared(json="hang_guard")
    text: dict = declared(json="text", derive=_formulas)
    w: Callable = declared()            # vectorized w(r, μ, A) as derived, for callers' own checks
    w_numeric: Callable = declared()    # the same by the IR's float rules (nan where undefined): the plot's

    def __repr__(self) -> str:
        """One line of at most REPR_WIDTH characters, w cut short with " …" where it is long
        (a piecewise w runs to hundreds): report() is the whole analysis."""
        head, tail = f"<Analysis of {self.name}: w = ", f"; {len(self.warnings)} warning(s)>"
        w, room = str(self.text.get("weight")), max(REPR_WIDTH - len(head) - len(tail), 12)
        return head + (w if len(w) <= room else w[:room - 2].rstrip() + " …") + tail

    # the presentation registers itself here (analysis.present.notebook): the result knows no report
    def report(self) -> str:
        """The report drpo-analyze prints, as text; print(result) prints it too."""
        return RENDER["text"](self)

    __str__ = report

    def to_json(self) -> dict:
        """drpo-analyze --json's JSON."""
        return RENDER["json"](self)

    def _repr_markdown_(self) -> str:
        return RENDER["markdown"](self)

    def _repr_html_(self) -> str:
        return RENDER["html"](self)

    def __post_init__(self):
        for f in fields(self):
            if f.metadata["derive"]:
                setattr(self, f.name, f.metadata["derive"](self))

    # ---- dict-style access, as analyze() returned a dict before: kept for a release. It gives
    # what the dict held: the warnings as text, w and w_numeric as "_w" and "_w_numeric".
    _DICT_NAMES = {"_w": "w", "_w_numeric": "w_numeric"}

    def __getitem__(self, key):
        name = self._DICT_NAMES.get(key, key)
        if name not in {f.name for f in fields(self)}:
            raise KeyError(key)
        value = getattr(self, name)
        return _texts(value) if name == "warnings" else value

    def __setitem__(self, key, value):
        name = self._DICT_NAMES.get(key, key)
        if name not in {f.name for f in fields(self)}:
            raise KeyError(key)
        setattr(self, name, value)

    def get(self, key: str, default: object = None) -> object:
        try:
            return self[key]
        except KeyError:
            return default
