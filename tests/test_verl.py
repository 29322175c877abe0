"""verl's own policy losses are the oracle for openrlhf_drpo.verl. verl 0.9.1 cannot share this
environment (it needs transformers < 5.11, openrlhf 5.15.0), so its venv (scripts/setup_verl.sh,
run by scripts/setup.sh) runs tests/verl_oracle.py; a missing venv fails here, it is not skipped."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERL_PYTHON = Path(os.environ.get("VERL_VENV", ROOT / ".venv-verl")) / "bin" / "python"


def verl_python(code, path=()):
    """`code` in a fresh interpreter of verl's venv without verl's plugin hook, so the code
    itself imports the adapter; this checkout (after `path`) first on sys.path."""
    assert VERL_PYTHON.exists(), f"{VERL_PYTHON} is missing: run bash scripts/setup_verl.sh"
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), str(ROOT)])
    return subprocess.run([str(VERL_PYTHON), "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)


# what tests/verl_oracle.py must see refused, each with its exact type and message
ROLLOUT = ("ValueError: objective '{}' uses π_rollout, but verl gives a policy loss none: verl's policy-loss call "
           "passes rollout IS weights, not rollout log-probs; use an objective on μ with verl's "
           "algorithm.rollout_correction instead")
REFUSALS = {
    "rollout": ROLLOUT.format("icepop"),
    "rollout_by_config": ROLLOUT.format("tis_ppo"),
    "aggregate": "ValueError: the aggregation is verl's actor_rollout_ref.actor.loss_agg_mode, not an objective parameter",
    "dp_size": "ValueError: (global) batch_num_tokens is required when dp_size > 1",
    # GSPO's @aggregate line, which verl's loss_agg_mode replaced without a word
    "declared_aggregate": ("ValueError: actor_rollout_ref.actor.loss_agg_mode=token-mean: verl aggregates the policy "
                           "loss so, and objective 'gspo' declares @aggregate = seq-mean-token-mean, which verl's "
                           "aggregation would replace: set actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"),
    # verl's own policy losses' settings, which the objective replaces: refused naming its equivalent
    "clip_ratio_high": ("ValueError: actor_rollout_ref.actor.clip_ratio_high=0.28: verl's own policy losses read "
                        "this, and the objective 'ppo' replaces them, so it would have no effect: leave "
                        "clip_ratio_high=0.2. In the objective: clip_ratio_high: the objective's upper clip, "
                        "loss_mode=dsl:grpo_clip_higher?eps_high=0.28"),
    "clip_ratio_c_and_dro_beta": (
        "ValueError: actor_rollout_ref.actor.clip_ratio_c=10.0; actor_rollout_ref.actor.policy_loss.dro_beta=0.05: "
        "verl's own policy losses read these, and the objective 'drpo' replaces them, so they would have no effect: "
        "leave clip_ratio_c=3.0, policy_loss.dro_beta=None. In the objective: clip_ratio_c: dual clip's c, "
        "loss_mode=dsl:ppo_dual_clip?c=10.0 (or DPPO's truncation min(r, 10.0) written in the objective); "
        "policy_loss.dro_beta: DRO's penalty, loss_mode=dsl:dro?tau=0.05"),
}


def test_every_shipped_objective_that_mirrors_a_verl_loss_equals_it_in_loss_and_gradient_in_every_mode():
    assert VERL_PYTHON.exists(), f"{VERL_PYTHON} is missing: run bash scripts/setup_verl.sh"
    env = dict(os.environ, PYTHONPATH=str(ROOT), VERL_USE_EXTERNAL_MODULES="openrlhf_drpo.verl")
    proc = subprocess.run([str(VERL_PYTHON), str(ROOT / "tests" / "verl_oracle.py")], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows and rows[-1].get("summary"), proc.stderr[-3000:]
    summary, rows = rows[-1], rows[:-1]
    bad = [r for r in rows if not r["ok"]]
    assert proc.returncode == 0 and not bad and summary["failures"] == 0, (bad[:5], summary, proc.stderr[-2000:])
    # every verl mode the issue names, in every aggregation it honours, with and without IS weights
    covered = {(r["verl"], r["mode"], r["is_weights"]) for r in rows}
    modes = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
    for verl_mode in ["vanilla", "gspo", "dppo_tv", "dppo_kl", "cispo", "gpg", "dro"]:
        assert all((verl_mode, m, w) in covered for m in modes for w in (False, True)), verl_mode
    assert {("sapo", "seq-mean-token-mean", w) for w in (False, True)} <= covered
    assert {("geo_mean", "seq-mean-token-mean", w) for w in (False, True)} <= covered
    assert summary["hooked"] and summary["control_differs"] and summary["located_error"] and summary["no_openrlhf"]
    assert summary["config_params"] and summary["by_path"]     # loss_mode="dsl:drpo?delta=0.3", a path
    assert summary["malformed"] == ("ValueError: loss_mode 'dsl:drpo?delta': write "
                                    "dsl:<name or path>?<param>=<value>&<param>=<value>")
    assert summary["refusals"] == REFUSALS, summary["refusals"]
    assert summary["equivalents_resolve"], summary["unresolved"]     # each dsl: loss_mode a refusal names
    import dsl
    from openrlhf_drpo.core.loss import objective_inputs
    # every shipped objective but those reading what verl's actor never gives (the rollout policy,
    # Σ_v π_v² or the whole batch); π_ref, H and groups come from its actor loss (test_verl_inputs.py)
    reads = {f"dsl:{n}": objective_inputs(dsl.load(n)).keys() - {"ref_log_probs", "entropy", "groups"}
             for n in dsl.shipped_names()}
    assert {n for n, r in reads.items() if not r} <= set(summary["registered"])
    assert not {n for n, r in reads.items() if r} & set(summary["registered"]) and "dsl:icepop" in reads
    assert {"dsl:grpo_k3", "dsl:entropy_bonus"} <= set(summary["registered"]) and "dsl:otb" in reads


# verl's registry, its lookup as a caller imported it by name before the adapter (verl's actor
# loss), the environment and the import hooks; then the adapter's import, a membership test and
# a lookup of a loss_mode that carries its parameters
IMPORT = """
import json, os, sys
import verl.workers.utils.losses as actor_losses
from verl.trainer.ppo import core_algos
registry = core_algos.POLICY_LOSS_REGISTRY
verls, environ, hooks = set(registry), dict(os.environ), (list(sys.meta_path), list(sys.path_hooks))
import openrlhf_drpo.verl
live = core_algos.POLICY_LOSS_REGISTRY      # verl's, unless the import replaced it
imported = set(live) - verls
member = "dsl:drpo?delta=0.7" in live
after_member = set(live) - verls - imported
loss = actor_losses.get_policy_loss_fn("dsl:drpo?delta=0.7")
import verl.trainer.distillation.losses as distillation_losses     # imported after the adapter
print(json.dumps(dict(same_registry=live is registry, plain_dict=type(live) is dict, verls_kept=verls <= set(live),
                      imported=sorted(imported), environ_changed=sorted(set(environ.items()) ^ set(os.environ.items())),
                      hooks_changed=hooks != (list(sys.meta_path), list(sys.path_hooks)),
                      member=member, registered_by_member=sorted(after_member),
                      registered_by_lookup=sorted(set(live) - verls - imported - after_member),
                      resolved=loss is live.get("dsl:drpo?delta=0.7"),
                      lookups_are_the_adapters=[m.get_policy_loss_fn is openrlhf_drpo.verl.get_policy_loss_fn
                                                for m in (core_algos, actor_losses, distillation_losses)],
                      actor_losses_are_the_adapters=[m.ppo_loss is openrlhf_drpo.verl.ppo_loss
                                                     for m in (actor_losses, distillation_losses)])))
"""


@pytest.fixture(scope="module")
def imported():
    proc = verl_python(IMPORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_importing_the_adapter_extends_verls_own_registry_and_changes_no_environment_or_import_hook(imported):
    assert imported["same_registry"] and imported["plain_dict"] and imported["verls_kept"], imported
    assert "dsl:drpo" in imported["imported"]
    assert imported["environ_changed"] == [] and not imported["hooks_changed"], imported


def test_a_membership_test_registers_nothing_and_a_lookup_resolves_only_the_name_asked_for(imported):
    assert not imported["member"] and imported["registered_by_member"] == [], imported
    # through the lookup verl's actor loss imported by name before the adapter was
    assert imported["registered_by_lookup"] == ["dsl:drpo?delta=0.7"] and imported["resolved"], imported
    # verl's callers import the lookup by name: the one imported before the adapter and the one after
    assert imported["lookups_are_the_adapters"] == [True, True, True], imported
    # and verl's actor loss, which hands π_ref, H and uid on (test_verl_inputs.py), the same way
    assert imported["actor_losses_are_the_adapters"] == [True, True], imported


# another verl: its package metadata first on sys.path, or a policy loss or agg_loss of another
# signature (as verl's own registration API and module attribute would carry it)
OTHER_VERL = {
    "version": ("", "verl 0.9.2 is installed; the adapter is built against verl==0.9.1"),
    "policy_loss": ("from verl.trainer.ppo.core_algos import register_policy_loss\n"
                    "register_policy_loss('vanilla')(lambda old_log_prob, log_prob, advantages, response_mask, "
                    "loss_agg_mode='token-mean', config=None, rollout_log_probs=None: None)\n",
                    "verl's policy loss (vanilla) takes ['old_log_prob', 'log_prob', 'advantages', 'response_mask', "
                    "'loss_agg_mode', 'config', 'rollout_log_probs'], expected"),
    "agg_loss": ("from verl.trainer.ppo import core_algos\n"
                 "core_algos.agg_loss = lambda loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, "
                 "global_batch_size=None: None\n",
                 "verl's agg_loss takes ['loss_mat', 'loss_mask', 'loss_agg_mode', 'dp_size', 'batch_num_tokens', "
                 "'global_batch_size'], expected"),
    "ppo_loss": ("import verl.workers.utils.losses as losses\n"
                 "losses.ppo_loss = lambda config, model_output, data: None\n",
                 "verl's actor loss (ppo_loss) takes ['config', 'model_output', 'data'], expected"),
}


@pytest.mark.parametrize("what", OTHER_VERL)
def test_another_verl_is_refused_on_import_saying_what_differs(tmp_path, what):
    setup, message = OTHER_VERL[what]
    if what == "version":
        metadata = tmp_path / "verl-0.9.2.dist-info" / "METADATA"
        metadata.parent.mkdir()
        metadata.write_text("Metadata-Version: 2.1\nName: verl\nVersion: 0.9.2\n")
    proc = verl_python(setup + "import openrlhf_drpo.verl\n", path=[tmp_path])
    assert proc.returncode == 1 and f"RuntimeError: openrlhf_drpo.verl: {message}" in proc.stderr, proc.stderr[-2000:]


# The third version's inputs under verl: Σ_v π_v² and the batch refused at registration (π_ref, H
# and groups come from verl's actor loss: test_verl_inputs.py); the KL forms and the entropy bonus
# held to verl's own kl_penalty and agg_loss (verl computes them outside the policy loss, from
# ref_log_prob and the entropy); a prefix objective (response-local: verl's micro-batch holds whole
# responses) through verl's get_policy_loss_fn against a hand-written torch of it. Float64, loss
# and gradient, fused and plain.
REFUSED = {
    "otb_weight": ("r*A*(1 - sg(sum_π_sq))\n", "objective 'otb_weight' uses sum_π_sq (Σ_v π_v²), but verl computes "
                   "no Σ_v π_v² at the update: its trainer sets calculate_sum_pi_squared only for the old policy's "
                   "forward (ray_trainer._compute_old_log_prob, for OTB's advantage estimator), never in "
                   "_update_actor's batch, so the policy being trained has none"),
    "otb": (open(ROOT / "objectives" / "otb.dsl").read(), "objective 'otb' uses sum_π_sq (Σ_v π_v²), but verl "
            "computes no Σ_v π_v² at the update"),
    "batch_pull": ("r*A - 0.1*(log(π) - batch_mean(log(π)))^2\n", "objective 'batch_pull' uses batch_mean (the "
                   "optimizer step's whole batch, in one loss call or through batch_statistics() over its micro-batches), but verl calls a policy loss once "
                   "per micro-batch (ppo_micro_batch_size_per_gpu), not once per optimizer step's batch"),
    "adaptive_kl": (open(ROOT / "objectives" / "adaptive_kl.dsl").read(), "objective 'adaptive_kl' uses β (state "
                    "kept across optimizer steps: updated once after each step with the same value on every rank, "
                    "logged, saved with the checkpoint and restored), but verl calls a policy loss once per "
                    "micro-batch, with no call after the optimizer step"),
    "schedule": ("r*A*(1 - min(step/100, 1))\n", "objective 'schedule' uses step (state kept across optimizer "
                 "steps"),
}
# verl's kl_loss_type -> the same KL in the language, as the objective -KL (the loss is +KL)
K3 = "x = clip(log(π_ref) - log(π), -20, 20)\nk = clip(exp(x) - x - 1, -10, 10)\n"
K2 = "q = 0.5*(log(π) - log(π_ref))^2\n"
KL_FORMS = {
    "k1": "-(log(π) - log(π_ref))\n",
    "abs": "-|log(π) - log(π_ref)|\n",
    "k2": K2 + "-q\n",
    "low_var_kl": K3 + "-k\n",
    "k3+": K3 + K2 + "-(q - sg(q) + sg(k))\n",      # k3's value, k2's gradient (verl's straight-through '+')
    "k1+": K2 + "-(q - sg(q) + sg(log(π) - log(π_ref)))\n",
}
PREFIX = ("c = 0.05\nS = prefix_sum(log(r))\nR = exp(sg(S - log(r)) + log(r))\nb = c*prefix_sum(1)^0.5\n"
          "min(R*A, exp(clip(log(R), -b, b))*A)\n")
V3 = """
import json, torch
import openrlhf_drpo.verl as adapter
from openrlhf_drpo.core import Aggregation, CompiledLoss
from dsl import parse
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from verl.workers.config import ActorConfig, PolicyLossConfig
REFUSED, KL_FORMS, PREFIX = json.loads(%r)
out = dict(refused={}, kl={}, prefix={})
for name, (text, _) in REFUSED.items():
    try:
        adapter.register(parse(text, name + ".dsl"))
        out["refused"][name] = None
    except ValueError as e:
        out["refused"][name] = str(e)
g = torch.Generator().manual_seed(0)
B, T = 6, 7
logp = -3 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.05
ref = (logp + 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
logp[0, 0], ref[0, 0], logp[0, 1], ref[0, 1], logp[1, 0], ref[1, 0] = -27, -1, -0.5, -30, -4, -1   # k3 clamped at 10
old = logp - 0.3 * torch.rand(B, T, generator=g, dtype=torch.float64)
A = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
entropy = 2 * torch.rand(B, T, generator=g, dtype=torch.float64)
lengths = torch.tensor([7, 5, 1, 0, 3, 6])
mask = torch.arange(T) < lengths[:, None]

def loss_and_grad(f, x):
    x = x.clone().requires_grad_()
    loss = f(x)
    return loss.item(), torch.autograd.grad(loss, x)[0]

def same(a, b, rtol=1e-12):
    return abs(a[0] - b[0]) <= rtol * abs(b[0]) + 1e-15 and torch.allclose(a[1], b[1], rtol=rtol, atol=1e-15)

for form, text in KL_FORMS.items():
    theirs = loss_and_grad(lambda x: agg_loss(kl_penalty(x, ref, form), mask, "token-mean"), logp)
    for fused in (True, False):
        ours = CompiledLoss(parse(text, "kl.dsl"), fused=fused)
        mine = loss_and_grad(lambda x: ours(x, old, A, mask, ref_log_probs=ref,
                                            aggregation=Aggregation("token-mean"))[0], logp)
        out["kl"][f"{form}:{fused}"] = same(mine, theirs)
# verl's entropy bonus: policy_loss -= entropy_coeff * agg_loss(entropy)
theirs = loss_and_grad(lambda h: -0.01 * agg_loss(h, mask, "token-mean"), entropy)
for fused in (True, False):
    ours = CompiledLoss(parse("0.01*H", "entropy_bonus.dsl"), fused=fused)
    mine = loss_and_grad(lambda h: ours(logp, old, A, mask, entropy=h, aggregation=Aggregation("token-mean"))[0],
                         entropy)
    out["kl"][f"entropy_coeff:{fused}"] = same(mine, theirs)

def prefix_by_hand(x, prefix=True):
    log_r = (x - old) * mask
    S = torch.cumsum(log_r, -1) if prefix else log_r
    log_R = (S - log_r).detach() + log_r
    b = 0.05 * torch.cumsum(mask.double(), -1) ** 0.5
    R = log_R.exp()
    return -torch.minimum(R * A, log_R.clamp(-b, b).exp() * A)

cfg = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                  policy_loss=PolicyLossConfig(loss_mode="vanilla"))
for fused in (True, False):
    mode = adapter.register(parse(PREFIX, "ctpo_like.dsl"), name=f"ctpo_like:{fused}", fused=fused)
    for agg in ("token-mean", "seq-mean-token-mean"):
        theirs = loss_and_grad(lambda x: agg_loss(prefix_by_hand(x), mask, agg), logp)
        mine = loss_and_grad(lambda x: get_policy_loss_fn(mode)(old_log_prob=old, log_prob=x, advantages=A,
                                                                 response_mask=mask, loss_agg_mode=agg, config=cfg,
                                                                 rollout_is_weights=None)[0], logp)
        out["prefix"][f"{agg}:{fused}"] = same(mine, theirs, rtol=1e-10)
control = loss_and_grad(lambda x: agg_loss(prefix_by_hand(x, prefix=False), mask, "token-mean"), logp)
out["prefix_differs_from_token_level"] = not same(control, loss_and_grad(
    lambda x: agg_loss(prefix_by_hand(x), mask, "token-mean"), logp), rtol=1e-3)
out["registered"] = sorted(n for n in adapter.SHIPPED)
print(json.dumps(out))
""" % json.dumps([REFUSED, KL_FORMS, PREFIX])


@pytest.fixture(scope="module")
def third_version():
    proc = verl_python(V3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", REFUSED)
def test_an_objective_reading_what_verls_policy_loss_lacks_is_refused_at_registration_saying_why(third_version,
                                                                                                 name):
    assert third_version["refused"][name] is not None, name
    assert third_version["refused"][name].startswith(REFUSED[name][1]), third_version["refused"][name]


@pytest.mark.parametrize("form", [*KL_FORMS, "entropy_coeff"])
def test_each_verl_kl_form_and_its_entropy_bonus_written_in_the_language_equals_verls_in_loss_and_gradient(
        third_version, form):
    assert third_version["kl"][f"{form}:True"] and third_version["kl"][f"{form}:False"], third_version["kl"]


def test_a_prefix_objective_runs_through_verls_policy_loss_and_equals_its_hand_written_form(third_version):
    assert third_version["prefix"] and all(third_version["prefix"].values()), third_version["prefix"]
    assert third_version["prefix_differs_from_token_level"]      # not vacuous: the prefix acts
