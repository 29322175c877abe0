"""The warnings a result raises, as data: each an Alert, a kind and the values it names (a
boundary that cannot be reached and where it lies, an unbounded weight and its range, a claim
the arbiter disagrees with and the point where it does, ...), decided here from the result,
the grid's facts and the on-policy weight. The words for each kind are analysis.present.alert_text's."""
from __future__ import annotations

from dataclasses import dataclass, field

from openrlhf_drpo.analysis.numeric.events import describe

# Every kind an Alert can be (analysis.present.alert_text words each one; a kind it lacks fails its test).
KINDS = (
    "no gradient", "zero on part", "zero on policy", "touches only", "no boundary", "unreachable",
    "partly unreachable", "numeric boundary", "range unknown", "unbounded", "unbounded in |A|", "entangled",
    "numeric range",
    "weight disagrees", "range disagrees", "self-check failed", "self-check unconfirmed",
    "undefined", "pole", "touches", "undefined share", "on policy undefined", "on policy zero",
    "on policy negative",
    "by position", "degenerate held point",
)


@dataclass(frozen=True)
class Alert:
    """One warning: its kind and its values (a sign of A as 'positive'/'negative', numbers,
    SymPy expressions, places located by the arbiter, whether a claim of absence is proven)."""
    kind: str
    values: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown alert kind {self.kind!r}")


def _proven(claims) -> bool:
    """Whether every claim a warning rests on is proven (else its evidence is printed once,
    under the boundary it concerns)."""
    return all(c["status"] == "proven" for c in claims)


def _absence(res, adv) -> Alert | None:
    """A sign of A with no boundary: what stops nothing, and why."""
    c = res["claims"]["boundary"][adv]
    values = {"adv": adv, "proven": _proven([c])}
    if c["claim"] == "w ≡ 0":
        return Alert("no gradient", values)
    if c["zero_share"] > 0:
        return Alert("zero on part", {**values, "share": c["zero_share"]})
    if res["on_policy"][adv]["status"] == "zero":
        return Alert("zero on policy", values)
    if c["touches"]:
        return Alert("touches only", values)
    if res["geometry"] != "none":
        return Alert("no boundary", values)
    return None


def result_alerts(res, exact_range, by_magnitude=False) -> list[Alert]:
    """What the result's own fields warn of, per sign of A and then for w as a whole; by_magnitude:
    w is unbounded only as |A| → 0 or ∞ (analysis.numeric.extremes.w_range)."""
    out = []
    lo, hi = res["weight_range"]
    for adv in ("positive", "negative"):
        b, reach = res["boundary"][adv], res["claims"]["reachable"][adv]
        if not b["pi"] and not b["numeric"]:
            out += [a for a in [_absence(res, adv)] if a]
        elif not res["reachable"][adv]:
            out.append(Alert("unreachable", {"adv": adv, "pis": b["pi"], "proven": _proven(reach)}))
        elif not all(b["reachable"]):
            out.append(Alert("partly unreachable", {
                "adv": adv, "pis": [p for p, ok in zip(b["pi"], b["reachable"]) if not ok],
                "proven": _proven([c for c, ok in zip(reach, b["reachable"]) if not ok])}))
        if b["numeric"]:
            out.append(Alert("numeric boundary", {"adv": adv, "found": [(x["where"], x["kind"]) for x in b["numeric"]],
                                                  "derived": res["weight"] is not None}))
    if res["bounded"] is None:
        out.append(Alert("range unknown"))
    elif not res["bounded"]:
        out.append(Alert("unbounded in |A|" if by_magnitude else "unbounded", {"lo": lo, "hi": hi}))
    if res["geometry"] == "advantage-entangled":
        out.append(Alert("entangled"))
    if not all(exact_range) and None not in (lo, hi):
        out.append(Alert("numeric range"))
    wc = res["arbiter"]["weight"]
    if wc["status"] == "disagrees":
        out.append(Alert("weight disagrees", {"bad_points": wc["bad_points"], "points": wc["points"],
                                              "example": wc["example"]}))
    if res["arbiter"]["range"] == "disagrees":
        out.append(Alert("range disagrees"))
    status = res["self_check"]["status"]
    if status in ("failed", "unconfirmed"):
        out.append(Alert(f"self-check {status}"))
    return out


def domain_alerts(facts) -> list[Alert]:
    """Where the grid found ℓ or w undefined, a pole, or w touching 0."""
    out = []
    for adv in ("positive", "negative"):
        f = facts[adv]
        below = [u for u in f["undefined"] if u["below"]]
        above = [u for u in f["undefined"] if not u["below"]]
        if below and above and describe(below) == describe(above):
            out.append(Alert("undefined", {"adv": adv, "at": describe(below), "below": None, "above": None}))
        elif below or above:
            out.append(Alert("undefined", {"adv": adv, "at": None, "below": describe(below) if below else None,
                                           "above": describe(above) if above else None}))
        if f["poles"]:
            out.append(Alert("pole", {"adv": adv, "where": describe(f["poles"])}))
        if f["touches"]:
            out.append(Alert("touches", {"adv": adv, "where": describe(f["touches"])}))
    if facts["undefined_fraction"] > 0:
        out.append(Alert("undefined share", {"fraction": facts["undefined_fraction"]}))
    return out


def level_alerts(obj) -> list[Alert]:
    """What the file's levels warn of, beyond the held point (every token there shares A): a
    group reduction of A read position by position (dsl.objective.Objective.by_position)."""
    return [Alert("by position", {"text": text}) for text in obj.by_position()]


def on_policy_alerts(facts: dict) -> list[Alert]:
    """What the on-policy weight (r = 1, every step's first mini-batch) warns of."""
    out = []
    for adv in ("positive", "negative"):
        f = facts[adv]
        if f["status"] == "undefined":
            out.append(Alert("on policy undefined", {"adv": adv, "why": f["why"]}))
        elif f["status"] in ("zero", "negative"):
            out.append(Alert(f"on policy {f['status']}", {"adv": adv}))
    return out
