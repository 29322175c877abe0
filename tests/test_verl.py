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
    from openrlhf_drpo import lang
    # every shipped objective but those on the rollout policy, which verl's policy loss never receives
    usable = {f"dsl:{n}" for n in lang.shipped_names() if not lang.load(n).reads_rollout()}
    assert usable <= set(summary["registered"]) and "dsl:icepop" not in summary["registered"]


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
                                                for m in (core_algos, actor_losses, distillation_losses)])))
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
