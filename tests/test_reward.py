"""The math reward: math-verify on real answers, right, wrong and malformed."""
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
