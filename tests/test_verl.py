"""verl's own policy losses are the oracle for openrlhf_drpo.verl. verl 0.9.1 cannot share this
environment (it needs transformers < 5.11, openrlhf 5.15.0), so its venv (scripts/setup_verl.sh,
run by scripts/setup.sh) runs tests/verl_oracle.py; a missing venv fails here, it is not skipped."""
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERL_PYTHON = Path(os.environ.get("VERL_VENV", ROOT / ".venv-verl")) / "bin" / "python"


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
    assert summary["config_params"] and summary["malformed_refused"]     # loss_mode="dsl:drpo?delta=0.3"
    assert summary["by_path"] and summary["refused"], summary["refusals"]
    import dsl
    # every shipped objective but those on the rollout policy, which verl's policy loss never receives
    usable = {f"dsl:{n}" for n in dsl.shipped_names() if not dsl.load(n).reads_rollout()}
    assert usable <= set(summary["registered"]) and "dsl:icepop" not in summary["registered"]
