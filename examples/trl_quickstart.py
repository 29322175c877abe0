"""Train a tiny model with a shipped objective in TRL's GRPOTrainer on a laptop: no GPU, no download.

    python3 examples/trl_quickstart.py [--objective drpo:delta=0.2] [--steps 30] [--out runs/trl_quickstart]

Builds a tiny Llama and its word-level tokenizer locally (openrlhf_drpo/lab/toytask.py), and a
task whose reward is the fraction of completion words in a target set. ObjectiveGRPOTrainer is
TRL's GRPOTrainer with the objective as its policy loss: TRL generates, scores, normalizes the
advantages and steps the optimizer; the objective (a shipped name or a .dsl file, with NAME:k=v
values) computes the loss. Two passes over each generation (num_iterations=2), so that π moves
away from μ and the objective's boundary can act. Prints one line per step (the reward on the steps that generate).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if not __import__("torch").cuda.is_available():   # TRL imports DeepSpeed, which else says aloud
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # that it found no CUDA

TARGETS = {"w4", "w5", "w6", "w7"}      # a quarter of the words: a random policy scores about 0.25
COLUMNS = [("reward", "reward"), ("loss", "loss"), ("drpo_w_mean", "w_mean"),
           ("drpo_past_boundary_diverging", "past_div"), ("drpo_ratio_max", "ratio_max"), ("grad_norm", "grad_norm")]


def reward(completions, **kwargs):
    return [sum(w in TARGETS for w in c.split()) / max(len(c.split()), 1) for c in completions]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--objective", default="drpo:delta=0.2", help="shipped name or .dsl file, with NAME:k=v,... values")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=os.path.join("runs", "trl_quickstart"))
    args = p.parse_args(argv)

    import dsl
    try:
        name, params = dsl.parse_spec(args.objective)
        dsl.load(name).with_overrides(params, where="--objective")      # a bad objective stops here, located
    except dsl.DslError as e:
        print(e.render(), file=sys.stderr)
        return 1
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback
    transformers.utils.logging.set_verbosity_error()      # the table is the output: no progress bars
    transformers.utils.logging.disable_progress_bar()
    from trl import GRPOConfig

    from openrlhf_drpo.lab.toytask import SPECIAL, WORDS, tiny_llama
    from openrlhf_drpo.trl import ObjectiveGRPOTrainer

    os.makedirs(args.out, exist_ok=True)
    model, _, model_dir = tiny_llama(args.out, SPECIAL + WORDS, seed=0, hidden=32)
    model.save_pretrained(model_dir)
    prompts = Dataset.from_list([{"prompt": " ".join(WORDS[(3 * i + j) % 16] for j in range(4))} for i in range(64)])
    config = GRPOConfig(output_dir=os.path.join(args.out, "trainer"), use_cpu=True, per_device_train_batch_size=8,
                        num_generations=4, max_completion_length=6, max_steps=args.steps, learning_rate=1e-2,
                        logging_steps=1, report_to="none", save_strategy="no", seed=0, data_seed=0, bf16=False,
                        num_iterations=2, beta=0.0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = ObjectiveGRPOTrainer(objective=name, objective_params=params, model=model_dir, reward_funcs=reward,
                                   args=config, train_dataset=prompts,
                                   processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.remove_callback(PrinterCallback)      # its log dicts: the table below says it in one line a step
    print(f"TRL GRPOTrainer, objective {name} (maximized):")
    print("\n".join("  " + line for line in trainer.objective_loss.objective.canonical().splitlines()))
    print("step " + " ".join(f"{short:>10}" for _, short in COLUMNS))
    torch.manual_seed(0)
    trainer.train()
    for i, h in enumerate((h for h in trainer.state.log_history if "loss" in h), 1):
        print(f"{i:>4} " + " ".join(f"{h[key]:>10.4g}" if key in h else f"{'-':>10}" for key, _ in COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
