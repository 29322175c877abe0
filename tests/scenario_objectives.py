"""Random objectives over the group, batch and indicator constructs (issue 45): an advantage built
from A by group and batch reductions, a policy term, an optional indicator that reads the group,
the batch or r, an optional penalty; seeded, so that tests/test_scenarios.py's slice and
scripts/scenario_random.py's thousands draw the same objectives from the same seed."""
import random

ADVANTAGES = [
    "A", "seq_mean(A)", "seq_mean(A) - group_mean(seq_mean(A))",
    "(seq_mean(A) - group_mean(seq_mean(A)))/(group_std(seq_mean(A)) + {eps})",
    "A - batch_mean(seq_mean(A))", "group_max(seq_mean(A)) - group_mean(seq_mean(A))",
    "seq_mean(A)*group_count(A)/{k}", "group_min(seq_mean(A))",
]
TERMS = [
    "r*({adv})", "min(r*({adv}), clip(r, {lo}, {hi})*({adv}))", "log(r)*({adv})", "seq_mean(r)*({adv})",
    "max(r*({adv}), {lo}*({adv}))",
]
INDICATORS = [
    "", "[group_std(seq_mean(A)) > 0]*", "[group_mean(seq_mean(A)) < {c}]*", "[abs(seq_mean(A)) > {c}]*",
    "[r < {hi}]*", "[batch_mean(seq_mean(A)) > -{c}]*", "[group_count(r) > 1]*", "[group_max(seq_mean(A)) > {c}]*",
]
PENALTIES = ["", " - {beta}*(r - 1)^2", " - {beta}*group_mean(seq_mean(A))^2*r"]


def random_objective(rng: random.Random) -> str:
    values = {"eps": rng.choice(["1e-6", "0.1", "1"]), "k": rng.choice(["2", "8"]),
              "lo": rng.choice(["0.8", "0.5"]), "hi": rng.choice(["1.2", "1.28", "2"]),
              "c": rng.choice(["0", "0.1", "0.5"]), "beta": rng.choice(["0.01", "0.5"])}
    adv = rng.choice(ADVANTAGES).format(**values)
    term = rng.choice(TERMS).format(adv=adv, **values)
    return rng.choice(INDICATORS).format(**values) + term + rng.choice(PENALTIES).format(**values)


def draws(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [random_objective(rng) for _ in range(n)]
