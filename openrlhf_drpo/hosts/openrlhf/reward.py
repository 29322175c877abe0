"""Math reward for OpenRLHF: `--reward.remote_url <path to this file>` (any .py exposing
reward_func). The response's final answer (the last \\boxed{...}, else the last LaTeX or
plain expression) is verified against the reference with math-verify, the paper's verifier.

OpenRLHF calls reward_func(queries, prompts, labels) from a worker thread, where the
signal-based time limits of math-verify cannot run, so they are off here."""
from __future__ import annotations

import torch


def _response(query: str, prompt: str) -> str:
    # queries are prompt + response as decoded text; keep only what the model wrote
    return query[len(prompt):] if prompt and query.startswith(prompt) else query


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces matched), or None; unclosed is None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def score(response: str, reference: str) -> float:
    """1.0 if the response's final answer equals the reference, else 0.0 (also when either cannot
    be parsed: math-verify's parse gives [] and its verify False there, raise_on_error=False). Any
    other error (an API math-verify changed, a bug) is raised, never scored 0: silently, it would
    turn every reward of a run into 0."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    gold = parse(reference if "$" in reference or "\\boxed" in reference else f"${reference}$",
                 parsing_timeout=None, raise_on_error=False)
    boxed = last_boxed(response)
    if "\\boxed" in response and boxed is None:
        return 0.0            # an unclosed \boxed{ is malformed, not an answer to look around
    target = f"${boxed}$" if boxed is not None else response
    answer = parse(target, extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
                   parsing_timeout=None, raise_on_error=False)
    return 1.0 if gold and answer and verify(gold, answer, timeout_seconds=None, raise_on_error=False) else 0.0


def reward_func(queries, prompts, labels):
    rewards = torch.tensor([score(_response(q, p), str(label)) for q, p, label in zip(queries, prompts, labels)])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"accuracy": rewards}}
