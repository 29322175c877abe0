"""Try the whole drpo-train pipeline on a laptop: no GPU, no download.

    python3 examples/laptop_quickstart.py [--objective drpo] [--set delta=0.2] [--steps 24] [--out runs/quickstart]

Builds a tiny Llama and a synthetic task locally (openrlhf_drpo/lab/toytask.py: the reward is the
fraction of response words equal to a target word), then runs drpo-train on it in CPU mode:
vLLM generates, the reward function scores, the compiled objective trains on DeepSpeed's CPU
accelerator, and the weights go back into vLLM every step. Prints one line per step; the
full log is OUT/train.log, the trained model OUT/ckpt, TensorBoard logs OUT/tensorboard.
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if not __import__("torch").cuda.is_available():   # building the model imports DeepSpeed, which else
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # says aloud that it found no CUDA
from openrlhf_drpo.lab import toytask  # noqa: E402

# vllm_kl is OpenRLHF's k1 estimate mean(log π_rollout − log π_old) of the engine/trainer
# mismatch: a KL's sample mean, which can be negative, so the table names the estimator
COLUMNS = [("reward", "reward"), ("vllm_kl", "vllm_k1"), ("drpo_w_mean", "w_mean"),
           ("drpo_past_boundary_diverging", "past_div"), ("drpo_past_boundary_converging", "past_conv"),
           ("drpo_abs_pi_minus_mu", "|pi-mu|"), ("drpo_ratio_max", "ratio_max"), ("actor_grad_norm", "grad_norm")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--objective", default="drpo", help="shipped name or .dsl file")
    p.add_argument("--set", action="append", default=None, metavar="NAME=VALUE",
                   help="parameter override (repeatable); default for drpo: delta=0.2")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--out", default=os.path.join("runs", "quickstart"))
    args = p.parse_args(argv)
    if args.set is None:
        args.set = ["delta=0.2"] if args.objective == "drpo" else []

    os.makedirs(args.out, exist_ok=True)
    print(f"building the tiny model and task in {args.out} ...", flush=True)
    task = toytask.build(args.out)
    cmd = [sys.executable, "-m", "openrlhf_drpo.hosts.openrlhf.train", "--drpo.objective", args.objective, "--drpo.anchor", "rollout",
           *[a for kv in args.set for a in ("--drpo.set", kv)], *toytask.flags(task, args.out, steps=args.steps)]
    print("drpo-train " + " ".join(cmd[3:]), flush=True)
    log_path = os.path.join(args.out, "train.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if line.startswith("openrlhf-drpo:"):
                print(line.rstrip(), flush=True)
            for step in toytask.steps_from_log(line):
                if step["step"] == 1:
                    print("(vllm_k1: OpenRLHF's vllm_kl, the k1 estimate mean(log π_rollout − log π_old); "
                          "it can be negative)", flush=True)
                    print("step " + " ".join(f"{name:>10}" for _, name in COLUMNS), flush=True)
                print(f"{step['step']:>4} " + " ".join(f"{step.get(key, float('nan')):>10.4g}" for key, _ in COLUMNS), flush=True)
        rc = proc.wait()
    if rc != 0:     # show why: the end of the log (drpo-train's own error line is last)
        print("".join(open(log_path).readlines()[-40:]), end="", file=sys.stderr)
    print(f"drpo-train exited with {rc}; log: {log_path}; model: {os.path.join(args.out, 'ckpt')}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
