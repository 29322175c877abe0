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
# file whole on one worker (its module fixtures run once), handed out in collection order. The
# longest files go first, longest first, so that the short ones fill in around them at the end: a
# long file left to its alphabetical place (test_trl.py, test_train_v3.py, test_verl.py) ran on
# alone after the rest were done. Measured one at a time under a load average of 15-20 (2 cores):
# trl 463 s, docs 286, verl 185, verl_inputs 80, launch 79, scenarios 65, token_claims 60,
# multinode 55, vocabulary_train 45; the last full run: two_ranks 556 (7 launches; 3 since),
# lab 262, pipeline 215 (3 launches; 2 since, measured here 228 -> 135 s: ~130), train_controls 110;
# train_v3 218 and accumulation_train 136 before their DeepSpeed checks shared one process per file
# (measured here 68 -> 37 s and 39 -> 22 s: ~120 and ~77 at that load); the other five (arbiter,
# analysis, contributing, train, accumulation_trl) took 90-480 s when last measured. The last full
# run (17:00 in a fast phase of this machine, in seconds on one worker): two_ranks 298 (3 launches),
# lab 252 (4), pipeline 181 (2), train_controls 169 (2), contributing 117, analysis 94, docs 78,
# loss 75, arbiter 69, train 62, trl 51. Re-measure when one changes much; list here any file over ~45 s.
LONGEST = ("test_two_ranks.py", "test_lab.py", "test_trl.py", "test_arbiter.py", "test_docs.py", "test_analysis.py",
           "test_contributing.py", "test_verl.py", "test_pipeline.py", "test_train.py", "test_accumulation_trl.py",
           "test_train_v3.py", "test_train_controls.py", "test_verl_inputs.py", "test_launch.py",
           "test_accumulation_train.py", "test_scenarios.py", "test_token_claims.py", "test_multinode.py",
           "test_vocabulary_train.py")


def pytest_configure(config):
    # xdist (3.x) would hand the files out by their number of tests, most first (its
    # --loadscope-reorder, on by default): long files of few tests (the two Ray files' 2 and 4,
    # test_contributing's 5) came last, and ran on after the short ones were done
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST)))


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
