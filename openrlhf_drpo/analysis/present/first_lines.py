"""The first screen's lines for what the gradient carries beside w·r·A: the objective's own
advantage Â (analysis.batch.advantage), and one line per channel (H, π_ref, Σπ²) with its effect, each
as the evidence below derives it (analysis.symbolic.channels)."""
from __future__ import annotations

from openrlhf_drpo.analysis.batch.advantage import shown_value
from openrlhf_drpo.analysis.mathtext import fmt, math_text

SHORT = 48      # characters of a channel's terms the first screen prints; longer, it names them


def _term_text(parts) -> str:
    """The file's terms as a sum a reader scans: + c·H."""
    return " ".join(f"{'+' if s > 0 else '−'} {t.replace(' * ', '·').replace('*', '·')}" for s, t in parts)


def advantage_line(res) -> list[tuple[str, str]]:
    adv = getattr(res, "advantage", None)
    if adv is None:
        return []
    held = adv["held"] or {}
    text = f"Â = {adv['name']}, built from the host's A: w, the trust region and the worries are against Â"
    if held.get("value") is not None and adv.get("reads_group"):
        group = ", ".join(f"{c:g}" for c in adv["group"])
        text += f"; for the group's advantages A·({group}) (--group), Â = {shown_value(held['value'])}"
        if held["zero"]:
            text += ": no gradient there"
    if held.get("value") is not None:
        text += "".join(f"; Â = 0 for {x}: those tokens get no gradient" for x in held.get("dead", []))
        for e in held["eps"]:
            text += f", Â/A up to {fmt(e['sup'])} only where {e['where']} → 0: the {fmt(e['eps'])}"
    return [("advantage", text)]


def _entropy(res) -> str | None:
    ch = res.entropy
    if ch is None:
        return None
    w_h, terms = ch["w_H"], _term_text(ch.get("terms") or [])
    lead = f"{terms}: " if terms else ""
    if w_h is None:
        return f"{lead}the entropy's own gradient w_H is not derived (notes below)"
    value = w_h.subs({s: res.params[s.name] for s in w_h.free_symbols if s.name in res.params})
    if value == 0:
        return f"{lead}H is read without a gradient through it (w_H = 0): it only sets w, at the analysed H"
    if value.is_number:
        k = float(value)
        kind = "an entropy bonus" if k > 0 else "an entropy penalty"
        return f"{lead}{kind}, {fmt(abs(k))} per token, with its gradient through H"
    return f"{lead}w_H = {math_text(w_h, weight=True)}: a gradient through H beside w's"


def _reference(res) -> str | None:
    ref = res.reference
    if ref is None:
        return None
    terms = ref["terms"].replace(" * ", "·")
    if len(terms) > SHORT:      # the evidence prints them whole
        terms = "the terms that read π_ref"
    if not ref["own"]:
        return f"{terms}: π_ref is inside the policy terms, so w reads it (at the analysed ρ_ref = π_ref/μ)"
    if ref["grad"] is None:
        return f"{terms}: its own channel beside w, ∂ℓ_ref/∂log π not derived (notes below)"
    return (f"{terms}: its own channel beside w, ∂ℓ_ref/∂log π = {math_text(ref['grad'], weight=True)} "
            "(q = π_ref/π); nothing about w reads it")


def _sum_pi_sq(res) -> str | None:
    if not any(h["name"] == "sum_pi_sq" for h in (getattr(res, "scope", None) or {}).get("held", [])):
        return None
    return "Σ_v π_v² enters without a gradient (the host detaches it), analysed as π² + (1 − π)²"


def channel_lines(res) -> list[tuple[str, str]]:
    """(label, text) per channel the objective reads."""
    out = [("entropy", _entropy(res)), ("reference", _reference(res)), ("Σπ²", _sum_pi_sq(res))]
    return [(label, text) for label, text in out if text]
