"""Names in the language: canonical ASCII spellings, their Unicode display, and the built-ins."""
from __future__ import annotations

# Canonical names are ASCII; Unicode is for display. λ is 'lam' so the name stays a
# valid Python/SymPy identifier in generated code and in `sympify`-able output.
GREEK = {
    "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "eps": "ε", "zeta": "ζ",
    "eta": "η", "theta": "θ", "iota": "ι", "kappa": "κ", "lam": "λ", "mu": "μ", "nu": "ν",
    "xi": "ξ", "omicron": "ο", "pi": "π", "rho": "ρ", "sigma": "σ", "tau": "τ",
    "upsilon": "υ", "phi": "φ", "chi": "χ", "psi": "ψ", "omega": "ω",
    "Gamma": "Γ", "Delta": "Δ", "Theta": "Θ", "Lambda": "Λ", "Xi": "Ξ", "Pi": "Π",
    "Sigma": "Σ", "Phi": "Φ", "Psi": "Ψ", "Omega": "Ω",
}
_ALIASES = {"epsilon": "eps", "lambda": "lam", "ς": "sigma"}
_TO_ASCII = {**{u: a for a, u in GREEK.items()}, **_ALIASES}

BUILTINS = {
    "r": "the importance ratio π/μ",
    "pi": "the current probability of the sampled token",
    "mu": "the behaviour probability of the sampled token",
    "A": "the advantage",
    # the two probabilities μ can be (@anchor picks which one μ is), each nameable on its own
    "pi_old": "the trainer's recomputed old (proximal) probability of the sampled token",
    "pi_rollout": "the rollout engine's (vLLM's) probability of the sampled token",
    "seq_len": "the number of unmasked tokens in this response",
    # the language's third version (docs/language.md): a host supplies each where it has it
    "pi_ref": "the reference model's probability of the sampled token",
    "H": "the policy's entropy at the token, in nats over the vocabulary (with its gradient)",
    "sum_pi_sq": "Σ_v π_v², the policy's collision probability at the token (no gradient)",
    # the language's fourth version: multi-turn episodes and asynchronous rollouts
    "turn_len": "the number of unmasked tokens in this token's turn (turn ids within a response)",
    "staleness": "the policy versions between the behaviour policy that sampled the token and the current one",
    # the fourth version's vocabulary entries: read only inside a vocabulary reduction (dsl.vocabulary)
    "pi_v": "the current policy's probability of a vocabulary entry v (with its gradient through the softmax)",
    "pi_ref_v": "π_ref's (or a teacher's) probability of a vocabulary entry v",
}
# words people write for a built-in: an unknown name among them is answered with the built-in
MEANT = {"entropy": "H", "ent": "H", "ratio": "r", "advantage": "A", "advantages": "A", "adv": "A",
         "pi_theta": "π", "old_pi": "π_old", "ref": "π_ref", "pi_reference": "π_ref", "length": "seq_len",
         "seq_length": "seq_len",
         "turn_length": "turn_len", "version_gap": "staleness"}
# the policies that are constants during an update, and the name of the log-prob tensor
# ObjectiveLoss receives for each
OTHER_POLICIES = {"pi_old": "old_log_probs", "pi_rollout": "rollout_log_probs", "pi_ref": "ref_log_probs"}
# the built-ins that read the current policy: r and π with a gradient, H with its own channel,
# Σ_v π_v² without one (its value still moves with the policy)
POLICY = ("r", "pi", "H", "sum_pi_sq", "pi_v")
GRADIENT = ("r", "pi", "H", "pi_v")
# the per-entry symbols: one value per vocabulary entry of the token's support (dsl.vocabulary)
ENTRIES = ("pi_v", "pi_ref_v")


def canonical_name(raw: str) -> str:
    """`ε_high`, `eps_high` and `epsilon_high` are one name: `eps_high`."""
    return "_".join(_TO_ASCII.get(part, part) for part in raw.split("_"))


def display_name(name: str) -> str:
    return "_".join(GREEK.get(part, part) for part in name.split("_"))
