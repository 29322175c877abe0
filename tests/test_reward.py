"""The math reward: math-verify on real answers, right, wrong and malformed."""
import math_verify
import pytest
import torch

from openrlhf_drpo.hosts.openrlhf.reward import reward_func, score


@pytest.mark.parametrize("response, reference, expected", [
    ("Adding them gives 3 + 4 = 7, so the answer is \\boxed{7}.", "7", 1.0),
    ("The probability is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("So x = \\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("Thus the roots are \\boxed{2, 3}.", "3, 2", 1.0),
    ("We get \\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("First I guessed \\boxed{5}, but rechecking, the answer is \\boxed{6}.", "6", 1.0),
    ("The answer is \\boxed{8}.", "7", 0.0),
    ("The answer is \\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("I am not sure.", "7", 0.0),
    ("The answer is \\boxed{\\frac{1}{", "1", 0.0),          # malformed LaTeX
    ("The answer is \\boxed{\\frac{1}{2}}}} $\\sqrt{$", "0.5", 1.0),     # stray braces and dollars after it
    ("The answer is \\boxed{7}.", "\\frac{", 0.0),                  # a reference it cannot parse
    ("", "7", 0.0),
])
def test_math_reward_verifies_the_final_answer(response, reference, expected):
    assert score(response, reference) == expected


def test_reward_func_follows_openrlhfs_reward_file_interface():
    prompts = ["What is 3 + 4? Put the answer in \\boxed{}.", "What is 2 * 3?"]
    queries = [prompts[0] + " It is \\boxed{7}.", prompts[1] + " It is \\boxed{5}."]
    out = reward_func(queries, prompts, ["7", "6"])
    assert set(out) == {"rewards", "scores", "extra_logs"}
    assert torch.equal(out["rewards"], torch.tensor([1.0, 0.0]))


def test_the_prompt_is_not_graded():
    # a boxed number in the prompt must not count as the model's answer
    prompt = "Example: \\boxed{7}. Now solve 2 + 2."
    assert reward_func([prompt + " I give up."], [prompt], ["7"])["rewards"].tolist() == [0.0]


@pytest.mark.parametrize("broken", ["parse", "verify"])
def test_an_error_of_math_verify_other_than_an_unparseable_answer_is_raised_not_scored_zero(monkeypatch, broken):
    """Every exception used to become 0.0: a math-verify whose API changed (a keyword it no longer
    takes) would score every response of a run 0 without a word. Only what its parse cannot read is 0."""
    def changed(*args, **kwargs):
        raise TypeError(f"{broken}() got an unexpected keyword argument 'parsing_timeout'")
    monkeypatch.setattr(math_verify, broken, changed)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        score("Adding them gives \\boxed{7}.", "7")
