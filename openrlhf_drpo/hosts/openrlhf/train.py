"""drpo-train: OpenRLHF's own train_ppo_ray command line plus --drpo.* flags, less the flags only
PolicyLoss reads (refused: the objective replaces PolicyLoss; options.SUPERSEDED).

    drpo-train --drpo.objective FILE_OR_NAME [--drpo.set NAME=VALUE]... [--drpo.anchor old|rollout]
               [--drpo.chunked_logprobs on|off] [--drpo.logprob_chunk TOKENS]
               [--drpo.vocab_topk K] [--drpo.teacher MODEL]
               [--drpo.cpu_mode auto|on|off] <openrlhf.cli.train_ppo_ray flags>

OpenRLHF is not forked: its CLI module runs under runpy while scoped patches (1) add the
--drpo.* flags to its parser, then parse, analyse and compile the objective in this driver
(a bad file fails here, before Ray starts) and ship its text and parameters inside the
args, and (2) point the launcher at a PolicyModelActor subclass that installs the compiled
objective where the trainer calls its policy loss, and (3) in asynchronous mode, at the trainer
that counts policy versions (versions.py). Pre-flight checks run at parse time, and
with neither a Ray cluster nor CUDA, CPU mode (hosts/openrlhf/cpu_mode.py) adapts the pipeline to this
machine's CPU (with --drpo.cpu_mode cluster, to a Ray cluster's CPUs); once the command line is
accepted, a line says which mode and why. Before any of this, with nothing heavy imported, the
errors of the command line that need no OpenRLHF are all shown at once (launch.early_errors). On a cluster, the driver's openrlhf_drpo and dsl reach every worker in
Ray's runtime environment.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.metadata
import json
import os
import runpy
import sys

from openrlhf_drpo.hosts.openrlhf.launch import (MISSING_OBJECTIVE, add_drpo_flags, code_runtime_env, cpu_mode_for,
                                                 cpu_mode_line, early_errors, help_layout, need_host, pre_parse,
                                                 preflight, ray_cluster, stop_local_ray)

OPENRLHF_CLI = "openrlhf.cli.train_ppo_ray"

class _Stop(Exception):
    """Raised to stop OpenRLHF's CLI right after it validated its args (openrlhf_args)."""


# the hooks a plugin may define, each replacing the OpenRLHF class it is named for: (module, name)
PLUGIN_HOOKS = {"trainer": ("openrlhf.trainer.ppo_trainer", "PPOTrainer"),
                "rollout_actor": ("openrlhf.trainer.ray.vllm_engine", "RolloutRayActor")}


def _plugin(argv: list[str]):
    """(the plugin module named by --drpo.plugin, its config), or None: imported by name, so
    drpo-train knows no plugin (drpo-lab plugs in here, through PLUGIN_HOOKS)."""
    pre = pre_parse(argv)
    name, path = getattr(pre, "drpo.plugin"), getattr(pre, "drpo.plugin_config")
    if name is None:
        return None
    config = {}
    if path is not None:
        with open(path) as f:
            config = json.load(f)
    return importlib.import_module(name), config


def _patch(stack: contextlib.ExitStack, owner, name: str, value) -> None:
    """owner.name = value until the stack closes: OpenRLHF is patched in scope, never forked."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    stack.callback(setattr, owner, name, original)


# OpenRLHF 0.11.2's defaults for --algo.advantage.is_correction_{level,mode,gating,threshold}
_IS_DEFAULTS = {"level": "off", "mode": "mask", "gating": "ratio", "threshold": [0.5, 5.0]}


def prepare_objective(args: argparse.Namespace, notes: list | None = None):
    """Parse, check and compile the objective named in the (flat) args; returns the spec every
    actor rebuilds it from, and the objective. Raises DslError or SystemExit with a clear message.
    Its notes go into `notes` where given (said once every check has passed), else are printed."""
    from dsl import load
    from dsl.objective import parse_overrides

    say = functools.partial(print, flush=True) if notes is None else notes.append
    spec_name = getattr(args, "drpo.objective")
    if not spec_name:
        raise SystemExit(MISSING_OBJECTIVE)
    options = {"anchor": getattr(args, "drpo.anchor")} if getattr(args, "drpo.anchor") else {}
    obj = load(spec_name).with_overrides(parse_overrides(getattr(args, "drpo.set"), "--drpo.set"), options, where="--drpo.set")
    # OpenRLHF applies its train/rollout IS correction inside PolicyLoss, which the objective
    # replaces: the same factor is composed with the objective instead, so the flags keep
    # their meaning (tests/test_sequence.py holds ppo composed so to PolicyLoss itself).
    correction = [getattr(args, f"algo.advantage.is_correction_{k}", d) for k, d in _IS_DEFAULTS.items()]
    if correction[0] != "off":
        from openrlhf_drpo.hosts.openrlhf.options import compose, is_correction_factor
        if obj.options["anchor"] == "rollout":
            # r is already π/π_rollout: the factor π_old/π_rollout on top would correct twice
            # (OpenRLHF's own GSPO takes its ratio against the rollout policy instead of the factor)
            raise SystemExit("drpo-train: error: --algo.advantage.is_correction_level with @anchor = rollout would "
                             "correct for the rollout policy twice (r is already π/π_rollout); use @anchor = old "
                             "with the correction, or write the correction into the objective")
        threshold = list(correction[3])
        if len(threshold) not in (1, 2):
            raise SystemExit("drpo-train: error: --algo.advantage.is_correction_threshold takes HIGH or LOW HIGH")
        threshold = [0.0, *threshold] if len(threshold) == 1 else threshold   # HIGH alone: an upper bound
        try:
            factor = is_correction_factor(correction[0], correction[1], correction[2], threshold)
        except ValueError as e:
            raise SystemExit(f"drpo-train: error: --algo.advantage.{e}") from None
        obj = compose(obj, factor)
        say("openrlhf-drpo: --algo.advantage.is_correction_* is composed with the objective; training and "
            f"the analysis use:\n  {obj.canonical().splitlines()[-1]}")
    if obj.reads_rollout():
        # OpenRLHF 0.11.2 keeps vLLM's log-probs only when IS correction is on; turning it on
        # here only keeps them: the correction itself lives in PolicyLoss, which is replaced.
        if correction[0] == "off":    # and a configuration PolicyLoss (still built) accepts
            for key, value in {**_IS_DEFAULTS, "level": "token"}.items():
                setattr(args, f"algo.advantage.is_correction_{key}", value)
    from openrlhf_drpo.hosts.openrlhf import controls
    from openrlhf_drpo.hosts.openrlhf.inputs import refuse_at_launch, trains_the_kl
    from openrlhf_drpo.hosts.openrlhf.loss import ObjectiveLoss
    # checks openrlhf's version and loss arity, compiles the code; refuses what this run cannot give it
    try:     # what drpo-train never gives (the policy's own top-k) is refused at construction
        loss = ObjectiveLoss(obj, compile=False)
    except ValueError as e:
        raise SystemExit(f"drpo-train: error: {e}") from None
    refuse_at_launch(loss, args)
    controls.refuse_at_launch(loss, args)       # what it cannot update, save or restore
    # a flag the objective would not read is refused, never ignored
    if getattr(args, "drpo.vocab_topk", None) is not None and loss.support is None:
        raise SystemExit(f"drpo-train: error: --drpo.vocab_topk: objective '{obj.name}' has no vocabulary sum "
                         "(ref_topk_sum) to read a top-k: leave the flag out")
    reads_ref = trains_the_kl(loss)
    if getattr(args, "drpo.teacher", None) is not None and not reads_ref:
        raise SystemExit(f"drpo-train: error: --drpo.teacher: objective '{obj.name}' reads neither π_ref nor its "
                         "top-k, which the teacher stands in for: leave the flag out")
    if reads_ref:
        say("openrlhf-drpo: the objective reads π_ref: its terms in π_ref are the KL trained; OpenRLHF's own KL "
            "loss (--algo.kl.use_loss, --algo.kl.init_coef) is logged as kl, not trained")
    return objective_spec(obj), obj


def objective_spec(obj) -> dict:
    """What every actor rebuilds the objective from: its text and parameters, not a path."""
    return {"source": obj.source, "path": obj.path, "params": {k: str(v) for k, v in obj.params.items()},
            "options": obj.options}


def _report(obj, args) -> None:
    """Print the analysis at start-up and save it beside the run's logs."""
    from dsl import DslError
    from openrlhf_drpo.analysis.orchestrator import analyze
    from openrlhf_drpo.analysis.present.report import report, to_json
    try:
        res = analyze(obj)
        text = report(res)
    except DslError as e:      # a vocabulary sum: the analysis says, located, why it does not apply; training goes on
        if not (obj.facts.vocabulary and e.message.startswith("the r-analysis does not apply to the vocabulary sum")):
            raise
        # a note, not an error: the run goes on (an "error:" line in a run that trains misleads)
        res, text = None, e.render().replace(": error: ", ": note: ", 1)
    print(text, flush=True)
    for folder in {getattr(args, "ckpt.output_dir", None), getattr(args, "logger.tensorboard_dir", None)} - {None}:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "drpo_objective.txt"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
        with open(os.path.join(folder, "drpo_objective.json"), "w", encoding="utf-8") as f:
            json.dump(to_json(res) if res is not None else {"not_analysed": text}, f, indent=2, ensure_ascii=False)


@contextlib.contextmanager
def _patched_openrlhf(on_parsed, cpu: bool = False, plugin=None):
    """Scoped patches: OpenRLHF's parser gains the --drpo.* flags and `on_parsed(args, cpu)`
    runs on the parsed namespace; its launcher uses the objective-installing actor class. In CPU
    mode its ray.init starts a local Ray with logical GPUs, and its vLLM, reference, critic and
    reward-model actors are the CPU-adapted ones. A plugin's hooks (PLUGIN_HOOKS) come last, so
    its classes extend CPU mode's."""
    from openrlhf_drpo.hosts.openrlhf import cpu_mode
    cpu_mode.install_flash_attn_shim()
    original_parse = argparse.ArgumentParser.parse_args
    parsed = {}

    def parse_args(parser, args=None, namespace=None):
        dests = {a.dest for a in parser._actions}
        if "actor.model_name_or_path" not in dests:        # not OpenRLHF's parser: leave it be
            return original_parse(parser, args, namespace)
        if "drpo.objective" not in dests:
            add_drpo_flags(parser)
            help_layout(parser)
        ns = original_parse(parser, args, namespace)
        on_parsed(ns, cpu)
        parsed["ns"] = ns
        # OpenRLHF's async trainer imports vLLM, whose import logs (Triton's probe): only once the
        # command line is accepted, so that a refusal prints the refusal alone
        from openrlhf.trainer import ppo_trainer_async
        from openrlhf_drpo.hosts.openrlhf.versions import VersionedTrainer
        _patch(stack, ppo_trainer_async, "PPOTrainerAsync", VersionedTrainer)    # tags policy versions
        return ns

    import ray
    from openrlhf.trainer.ray import ppo_actor
    from openrlhf.trainer.ray import launcher
    from openrlhf_drpo.hosts.openrlhf.actor import DrpoPolicyModelActor, DrpoReferenceModelActor
    original_init = ray.init

    def ray_init(*args, **kwargs):
        on_cluster = not cpu or getattr(parsed["ns"], "drpo.cpu_mode") == "cluster"
        cluster = ray_cluster() if on_cluster else None
        if cpu and cluster is None and on_cluster:
            raise SystemExit("drpo-train: error: --drpo.cpu_mode cluster: the Ray cluster is no longer set up")
        if cluster is not None:
            how = "CPU mode: DeepSpeed CPU accelerator, vLLM CPU backend, gloo weight sync; " if cpu else ""
            print(f"openrlhf-drpo: joining the Ray cluster at {cluster[0]} ({how}openrlhf_drpo and dsl shipped to its "
                  "workers in the runtime environment)", flush=True)
        if cluster:      # OpenRLHF's own call (CPU mode's), with this driver's code for every worker
            kwargs = cpu_mode.ray_init_kwargs(kwargs, parsed["ns"], cluster[0]) if cpu else kwargs
            context = original_init(*args, **{**kwargs, "runtime_env": code_runtime_env(kwargs.get("runtime_env") or {})})
            if cpu:
                cpu_mode.check_cluster_gpus(parsed["ns"])
            return context
        if cpu:
            kwargs = cpu_mode.ray_init_kwargs(kwargs, parsed["ns"])
            print(f"openrlhf-drpo: starting a local Ray with {kwargs['num_gpus']} logical GPUs (CPU mode: DeepSpeed "
                  "CPU accelerator, vLLM CPU backend, gloo weight sync)", flush=True)
        return original_init(*args, **kwargs)
    with contextlib.ExitStack() as stack:
        _patch(stack, argparse.ArgumentParser, "parse_args", parse_args)
        _patch(stack, ppo_actor, "PolicyModelActor", DrpoPolicyModelActor)
        _patch(stack, launcher, "ReferenceModelActor", DrpoReferenceModelActor)     # π_ref's top-k, a teacher
        _patch(stack, ray, "init", ray_init)
        for module, name, value in (cpu_mode.actor_patches() if cpu else []):
            _patch(stack, module, name, value)
        if plugin is not None:
            module, config = plugin
            for hook, (where, name) in PLUGIN_HOOKS.items():
                if hasattr(module, hook):
                    owner = importlib.import_module(where)
                    _patch(stack, owner, name, getattr(module, hook)(getattr(owner, name), config))
        yield


def _run_openrlhf(argv: list[str]) -> None:
    old_argv = sys.argv
    sys.argv = ["drpo-train", *argv]
    try:
        runpy.run_module(OPENRLHF_CLI, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = old_argv


def openrlhf_args(argv: list[str]):
    """OpenRLHF's own parsed and validated args for a command line (nothing starts): the
    same namespace its `train(args)` receives, with the objective spec in args.drpo.spec."""
    import ray
    from openrlhf.utils import config
    captured = {}
    original = config.hierarchize

    def hierarchize(ns):
        captured["args"] = original(ns)
        return captured["args"]

    def stop(*a, **k):      # train() asks first thing: stop right there
        raise _Stop()
    with _patched_openrlhf(_ship_spec, cpu_mode_for(argv)), contextlib.ExitStack() as stack:
        _patch(stack, config, "hierarchize", hierarchize)
        _patch(stack, ray, "is_initialized", stop)
        try:
            _run_openrlhf(argv)
        except _Stop:
            return captured["args"]
    raise RuntimeError("OpenRLHF's CLI returned without calling train()")


def check_objective(argv: list[str]) -> None:
    """The objective of a drpo-train command line, parsed, compiled and refused as drpo-train
    would (SystemExit, DslError), and nothing else: no pre-flight, no file written, no Ray, so
    that drpo-lab can refuse one before it builds its task."""
    def on_parsed(ns, cpu):
        prepare_objective(ns)
        raise _Stop()
    with _patched_openrlhf(on_parsed, cpu_mode_for(argv)):
        try:
            _run_openrlhf(argv)
        except _Stop:
            return
    raise RuntimeError("OpenRLHF's CLI returned without parsing its arguments")


def _ship_spec(ns, cpu: bool, mode_line: str | None = None) -> None:
    """On OpenRLHF's parsed args: the objective first (a bad file is the first error), then CPU
    mode's flags and the pre-flight checks, and only then is anything said (the mode line, the
    objective's notes) or written (the report)."""
    from openrlhf_drpo.hosts.openrlhf import cpu_mode
    from openrlhf_drpo.hosts.openrlhf.options import refuse_superseded
    notes = []
    spec, obj = prepare_objective(ns, notes)
    refuse_superseded(sys.argv[1:])     # PolicyLoss's own flags: the objective replaces them
    if cpu:
        cpu_mode.check_flags(ns, sys.argv[1:])
    preflight(ns, cpu)
    for line in filter(None, [mode_line, *notes]):
        print(line, flush=True)
    _report(obj, ns)
    if cpu and (note := cpu_mode.first_compile_note()):
        print(note, flush=True)
    if obj.options["anchor"] == "rollout":
        print("openrlhf-drpo: @anchor = rollout: r is π/μ against vLLM's log-probs; ppo_kl is OpenRLHF's drift "
              "from the trainer's log-probs at the start of the step (π_old), within the step; vllm_kl is the "
              "engine/trainer mismatch", flush=True)
    # The objective's text and parameters travel inside the args to every actor, on every
    # node: no path that might not exist elsewhere.
    setattr(ns, "drpo.spec", json.dumps(spec, ensure_ascii=False))


def _stop_local_ray() -> None:
    """stop_local_ray, whose own failure is said on one line and never replaces the run's outcome."""
    try:
        stop_local_ray()
    except Exception as e:      # noqa: BLE001 - the run's own exception or exit code goes on
        print(f"openrlhf-drpo: stopping the local Ray failed ({type(e).__name__}: {e}); check for stray Ray "
              "processes (ray stop --force)", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from dsl import DslError
    from openrlhf_drpo.hosts.openrlhf import cpu_mode
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--version"]:      # (OpenRLHF's own parser has none)
        from openrlhf_drpo import __version__
        try:
            host = f"OpenRLHF {importlib.metadata.version('openrlhf')}"
        except importlib.metadata.PackageNotFoundError:
            host = "OpenRLHF not installed: bash scripts/setup.sh installs it"
        print(f"drpo-train {__version__} ({host})")
        return 0
    traceback = "--traceback" in argv
    argv = [a for a in argv if a != "--traceback"]
    if not {"-h", "--help"} & set(argv) and (errors := early_errors(argv)):
        raise SystemExit("\n".join(errors))    # all of them, before anything heavy is imported
    need_host()
    cpu, mode_line = cpu_mode_line(argv)
    if cpu:
        kv_note = cpu_mode.kv_cache_gib(os.environ.get("VLLM_CPU_KVCACHE_SPACE"))[1]
        os.environ.update(cpu_mode.driver_environment())
        cpu_mode.check_versions()
        # said with the mode line, once every check has passed (nothing before an argument error)
        mode_line = "\n".join(filter(None, [mode_line, kv_note]))
    try:
        with _patched_openrlhf(functools.partial(_ship_spec, mode_line=mode_line), cpu, _plugin(argv)):
            # a Ray the caller already runs stays (ray.is_initialized's own test: a test patches that)
            worker = sys.modules.get("ray._private.worker")
            ours = not (worker and worker.global_worker.connected)
            try:
                _run_openrlhf(argv)
            finally:
                if ours:
                    _stop_local_ray()
    except DslError as e:
        if traceback:
            raise
        print(e.render(), file=sys.stderr)
        return 1
    except RuntimeError as e:
        if traceback or "openrlhf" not in str(e):
            raise
        print(f"drpo-train: error: {e}", file=sys.stderr)
        return 1
    return 0


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()
