"""OpenRLHF 0.11.2 imports flash_attn at module level: tests that import it in-process use the
product's own shim, exactly as drpo-train and ObjectiveLoss do (a real flash_attn wins).
Also: Hypothesis's CI profile, and the check that the suite leaves the working tree as it was."""
import os

from hypothesis import settings

from openrlhf_drpo.hosts.openrlhf.cpu_mode import install_flash_attn_shim

install_flash_attn_shim()

# CI draws the same examples on every run (a submission lands or not on its code, not on a
# draw); a developer's runs keep exploring new ones and report what they find.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


# The suite runs on two workers (`pytest -n 2`, pytest-xdist, `--dist loadfile` in setup.cfg): each
# file whole on one worker (its module fixtures run once). The files that start Ray, vLLM and
# DeepSpeed are the longest: they go first, so that the short ones fill in around them at the end.
PROCESSES = ("test_lab.py", "test_pipeline.py", "test_two_ranks.py", "test_train.py", "test_train_v3.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in PROCESSES)


def _tree_status(root):
    import subprocess
    proc = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=all"],
                          capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def pytest_sessionstart(session):
    session.config.stash_tree = _tree_status(session.config.rootpath)


def pytest_sessionfinish(session, exitstatus):
    # tests write only into temporary directories: the working tree is as the suite found it
    before = getattr(session.config, "stash_tree", None)
    after = _tree_status(session.config.rootpath)
    if before is not None and after != before:
        print(f"\nthe test suite changed the working tree (git status before/after):\n{before}---\n{after}")
        session.exitstatus = 1
