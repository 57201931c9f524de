"""`trace-rl`: the command line. `train` (the embedded default), `mismatch` (the headline
experiment), `audit` (every site's precision in trainer, engine and exported checkpoints), `plan`
(per-GPU memory and traffic of a run), `slurm` (its sbatch script) and `config` (the resolved
configuration, or the schema's reference).

The rollout backend is named by dotted path (`--engine module:Class`), so this package does not
import the rollout side (the layering is kernels <- megatron_trace <- sglang_rollout).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .backend import DEFAULT_ENGINE, backend_options, engine_factory
from .checkpoint.cli import add_audit_parser, audit_main
from .config import as_dict, load_config, reference_markdown
from .megatron.spawn import init_one_process
from .modes import RunMode


def _config(args):
    try:
        return load_config(args.config, (args.set or []) + (["rl.steps=0"] if args.command == "sft" else []))
    except ValueError as e:
        raise SystemExit(str(e)) from None


def train_main(args: argparse.Namespace) -> list[dict]:
    """`trace-rl train` / `sft`: colocated in this process, or this rank's part of a torchrun job; returns the RL
    steps' metrics."""
    import os

    from .rl.factories import engine_settings, resolve_model_config
    from .rl.job_layout import check_engine_settings, check_local_gpus
    from .rl.plan import engine_kv_blocks
    from .rl.slurm import torch_env_from_slurm
    from .rl.train import train

    os.environ.update(torch_env_from_slurm(dict(os.environ)))  # an srun task: torch.distributed's variables
    cfg = _config(args)
    if cfg.dist.engine_tp != 1 and cfg.rollout.backend == "builtin":
        raise SystemExit("error: dist.engine_tp > 1: the built-in engine runs on one GPU; rollout.backend=sglang "
                         "shards an engine over dist.engine_tp GPUs")
    try:
        check_engine_settings(cfg)
        model_cfg = resolve_model_config(cfg.model)
        if cfg.dist.engine_ranks:
            history = _lost_peer_exits(_train_disaggregated, cfg, model_cfg)
        else:
            if torch.cuda.is_available():  # a colocated SGLang engine of several GPUs takes the first ones
                check_local_gpus(list(range(cfg.dist.engine_tp)), torch.cuda.device_count(), cfg.dist.engine_tp, True)
            _init_trainer_process(cfg)
            make_engine = engine_factory(cfg.rollout.backend, model_cfg, cfg.model.preset, engine_kv_blocks(cfg),
                                         probe=engine_settings(cfg.rl), **backend_options(cfg))
            history = train(cfg, make_engine, model_cfg)
    except (ValueError, FileNotFoundError) as e:  # bad config for this run, an unusable checkpoint
        raise SystemExit(f"error: {e}") from None
    if history:
        k = max(1, len(history) // 4)
        first = sum(m["reward"] for m in history[:k]) / k
        last = sum(m["reward"] for m in history[-k:]) / k
        print(f"reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}; "
              f"k3_kl last {history[-1].get('k3_kl', float('nan')):.2e}; metrics in {cfg.output_dir}/metrics.jsonl, "
              f"plot in {cfg.output_dir}/report.png")
    return history


# what gloo, NCCL and the TCP store say when the other end of a connection is gone
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
             "failed to recv", "Socket Timeout", "NCCL communicator was aborted")


def _lost_peer_exits(fn, *args):
    """fn(*args); when another rank of the job failed (a collective or the store lost its peer),
    exit with a message that says so instead of a backend traceback."""
    import os

    try:
        return fn(*args)
    except (RuntimeError, ConnectionError, EOFError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if isinstance(e, RuntimeError) and not isinstance(e, torch.distributed.DistError) and \
                not any(s in str(e) for s in LOST_PEER):
            raise
        raise SystemExit(f"trace-rl: rank {os.environ.get('RANK', '?')} lost contact with another rank (it failed or "
                         f"was killed; see its log); stopping. [{type(e).__name__}: {first[:300]}]") from None


def _train_disaggregated(cfg, model_cfg) -> list[dict]:
    """This process's part of a torchrun job: an engine rank serves, a trainer rank trains."""
    import os

    import torch.distributed as dist

    from .rl.bridge import Bridge, Roles, rendezvous_store
    from .rl.disaggregated import RemoteEngine, serve_engine
    from .rl.factories import engine_settings
    from .rl.job_layout import check_local_gpus, rank_gpus
    from .rl.plan import engine_kv_blocks
    from .rl.train import train

    roles = Roles.from_env(cfg.dist.engine_ranks)
    # trainer ranks a GPU each, then each engine rank dist.engine_tp GPUs (rl/job_layout.py)
    gpus = rank_gpus(roles.rank, int(os.environ.get("LOCAL_RANK", 0)), roles.trainers,
                     1 if roles.is_trainer else cfg.dist.engine_tp)
    if torch.cuda.is_available():
        check_local_gpus(gpus, torch.cuda.device_count(), cfg.dist.engine_tp, not roles.is_trainer)
        gpus = [g % torch.cuda.device_count() for g in gpus]  # more ranks than GPUs: engines of one GPU share
        torch.cuda.set_device(gpus[0])
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    store = rendezvous_store()
    bridge = Bridge(store, roles, cfg.dist.bridge)
    if not roles.is_trainer:
        options = backend_options(cfg, gpus if torch.cuda.is_available() else None)
        serve_engine(bridge, engine_factory(cfg.rollout.backend, model_cfg, cfg.model.preset, engine_kv_blocks(cfg),
                                            probe=engine_settings(cfg.rl), **options))
        return []
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            store=dist.PrefixStore("trace-trainers", store), rank=roles.rank, world_size=roles.trainers)
    _init_trainer_process(cfg)
    try:
        return train(cfg, lambda precision, guide, coding: RemoteEngine(bridge, precision, guide, coding), model_cfg)
    finally:  # the engines wait for rank 0 whatever happened (torchrun ends the job if a rank failed)
        if roles.rank == 0:
            for e in roles.engines:
                bridge.send(("stop",), e)


def _init_trainer_process(cfg) -> None:
    """The trainer's distributed state on this rank (a one-rank group first when none is up):
    Megatron's parallel state for trainer.backend=megatron (with its CPU patches where there is
    no GPU), DeepSpeed's communication backend for deepspeed (Megatron's CPU patches stay off:
    they rewrite torch.cuda process-wide, which DeepSpeed must not see)."""
    if cfg.trainer.backend == "deepspeed":
        import os

        from .deepspeed.trainer import init_distributed

        if torch.distributed.is_initialized():  # the trainer ranks' own world: DeepSpeed checks its size against
            os.environ["WORLD_SIZE"] = str(torch.distributed.get_world_size())  # the launcher's (engines too)
        init_distributed()
        return
    if not torch.distributed.is_initialized():  # colocated: one process
        init_one_process()
        return
    from .megatron.cpu_patches import initialize_model_parallel_cpu

    d = cfg.dist
    initialize_model_parallel_cpu(tp=d.tp, pp=d.pp, ep=d.ep, etp=d.etp)


def plan_main(args: argparse.Namespace) -> int:
    """Print the run's plan (or, with --search, every layout's); 1 when it does not fit."""
    from .rl.plan import architecture, choose_layout, format_plan, make_plan, plan_json

    cfg = _config(args)
    try:
        arch = architecture(cfg)
        plans = choose_layout(cfg, arch) if args.search else [make_plan(cfg, arch)]
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.search:
        print(f"{'layout':<22} {'DP':>3} {'trainer GiB':>12} {'engine GiB':>11}  fits")
        for p in plans:
            dp = p.trainer_gpus // (p.layout.tp * p.layout.pp)
            print(f"{str(p.layout):<22} {dp:>3} {p.trainer_peak / 2**30:12.1f} {p.engine_total / 2**30:11.1f}  "
                  f"{'yes' if p.fits else 'no: ' + p.problems[0]}")
        print(f"\nchosen: {plans[0].layout}\n" if plans and plans[0].fits else "\nno layout fits\n")
    if plans:
        print(format_plan(plans[0]))
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps([plan_json(p) for p in plans], indent=1) + "\n")
        tmp.replace(args.json)
    return 0 if plans and plans[0].fits else 1


def slurm_main(args: argparse.Namespace) -> None:
    """Render the run's sbatch script (after checking its plan fits)."""
    from .rl.plan import architecture, format_plan, make_plan
    from .rl.slurm import render_sbatch

    if not args.config:
        raise SystemExit("trace-rl slurm needs --config: every task reads that file")
    cfg = _config(args)
    try:
        plan = make_plan(cfg, architecture(cfg))
        script = render_sbatch(cfg, args.config, args.set or [])
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if cfg.dist.engine_tp != 1 and cfg.rollout.backend == "builtin" and not args.force:
        raise SystemExit("error: dist.engine_tp > 1: the built-in engine runs on one GPU (rollout.backend=sglang "
                         "shards an engine over dist.engine_tp GPUs); --force renders the script anyway")
    if not plan.fits and not args.force:
        raise SystemExit(format_plan(plan) + "\n(--force renders the script anyway)")
    if args.out:
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(script)
        tmp.replace(args.out)
        print(f"wrote {args.out}: sbatch {args.out}")
    else:
        print(script, end="")


def config_main(args: argparse.Namespace) -> None:
    """Print the configuration a run with these arguments would use, or the schema's reference."""
    if args.reference:
        print(reference_markdown(), end="")
        return
    import yaml

    print(yaml.safe_dump(as_dict(_config(args)), sort_keys=False), end="")


DEFAULT_RUN = Path("runs/default")  # where `trace-rl train` (make demo) leaves the embedded default


def _mismatch_model(args):
    """(ModelConfig, one-process trainer holding the weights, their full state dict, what it is)."""
    from .checkpoint.dist import load_model, read_config
    from .megatron.model import build_model
    from .megatron.weights import load_full_state_dict
    from .model_config import PRESETS
    from .rl.run_checkpoint import latest_checkpoint

    megatron, what = args.megatron, None
    if not (args.model or args.hf or megatron):  # the embedded default: trained if it has been, else random
        latest = latest_checkpoint(DEFAULT_RUN) if (DEFAULT_RUN / "checkpoints").exists() else None
        if latest is not None:
            megatron, what = str(latest / "model"), f"the embedded default trained in {latest}"
        else:
            args.model, what = "demo", "the embedded default's model (demo preset), random weights (no trained run)"
    if args.hf:
        from .checkpoint.hf import HFCheckpoint

        ckpt = HFCheckpoint(args.hf)
        cfg, what = ckpt.model_cfg, f"HF checkpoint {args.hf}"
    elif megatron:
        cfg, what = read_config(megatron), what or f"Megatron checkpoint {megatron}"
    elif args.model in PRESETS:
        cfg, what = PRESETS[args.model], what or f"preset {args.model}, random weights (seed {args.seed})"
    else:
        raise SystemExit(f"--model: unknown preset {args.model!r}; choose from {sorted(PRESETS)}")
    if args.trainer == "deepspeed":  # transformers' model with TRACE's sites; no optimizer, so no engine
        if not args.hf:
            raise SystemExit("--trainer deepspeed reads an HF checkpoint: give --hf DIR")
        from .deepspeed.trainer import DeepSpeedTrainer, load_hf_model

        module = load_hf_model(args.hf, {}).to("cuda" if torch.cuda.is_available() else "cpu")
        return cfg, DeepSpeedTrainer(None, cfg, module=module), dict(ckpt.items()), what + " (DeepSpeed trainer)"
    from .megatron.trainer import MegatronTrainer

    init_one_process()
    model = build_model(cfg, "bf16", grouped_gemm=True)
    if args.hf:
        load_full_state_dict(model, ckpt)
    elif megatron:
        load_model(model, megatron)
    state_dict = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()
                  if not k.endswith("_extra_state")}  # one process: local names are the full names
    return cfg, MegatronTrainer(model, cfg), state_dict, what


def mismatch_main(args: argparse.Namespace) -> dict:
    """`trace-rl mismatch`: one rollout and one trainer forward per run mode; prints and returns {mode: metrics}."""
    from .rl.mismatch import run_mismatch
    from .rl.tasks import ArithmeticTask
    from .rollout import SamplingParams

    try:
        modes = [RunMode(m.strip()) for m in args.modes.split(",") if m.strip()]
    except ValueError as e:
        raise SystemExit(f"--modes: {e}") from None
    try:
        cfg, trainer, state_dict, what = _mismatch_model(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    task = ArithmeticTask(seed=args.seed)
    if args.prompt_source == "task" and task.tokenizer.vocab_size <= cfg.vocab_size:
        prompts, source = [tuple(task.prompt_ids(p)) for p in task.problems(args.prompts)], "arithmetic task"
    else:
        gen = torch.Generator().manual_seed(args.seed)
        prompts = [tuple(torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist())
                   for _ in range(args.prompts)]
        source = f"random tokens (seed {args.seed})"
    print(f"model: {what}; prompts: {source}")
    make_engine = engine_factory(args.engine, cfg, args.model or "model")

    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
    results = run_mismatch(trainer, make_engine, state_dict, prompts, modes=modes, guide=args.guide,
                           coding=args.coding, samples_per_prompt=args.samples, sampling=sampling)
    cols = ["k3_kl", "train_rollout_logprob_abs_diff", "flip_rate", "residual_flip_rate", "guidance_bits_per_element"]
    print(f"{'mode':11s} " + " ".join(f"{c:>31s}" for c in cols))
    for mode, m in results.items():
        print(f"{mode:11s} " + " ".join(f"{m[c]:31.3g}" if c in m else f"{'-':>31s}" for c in cols))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
        tmp.replace(args.json)  # never a half-written file
    return results


def _add_mismatch_parser(sub) -> None:
    mm = sub.add_parser("mismatch", help="engine vs trainer log-prob mismatch per run mode")
    src = mm.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="a model preset, random weights (seeded); default: the "
                     "embedded default's model, trained (runs/default) if make demo has run")
    src.add_argument("--megatron", default=None,
                     help="a Megatron checkpoint directory (e.g. a run's checkpoints/rl-000040/model)")
    src.add_argument("--hf", default=None, help="an HF Qwen3-MoE checkpoint directory")
    mm.add_argument("--prompt-source", default="task", choices=["task", "random"],
                    help="arithmetic-task prompts (when the vocabulary covers them) or random tokens")
    mm.add_argument("--modes", default=",".join(m.value for m in RunMode), help="run modes to compare")
    mm.add_argument("--guide", default="all", help="trace mode's layer policy: all, deep:K, layers:i,j, none")
    mm.add_argument("--coding", default="dense", choices=["dense", "sparse"])
    mm.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling")
    mm.add_argument("--prompts", type=int, default=4)
    mm.add_argument("--prompt-len", type=int, default=16)
    mm.add_argument("--samples", type=int, default=2, help="samples per prompt")
    mm.add_argument("--max-new-tokens", type=int, default=24)
    mm.add_argument("--engine", default=DEFAULT_ENGINE,
                    help="rollout backend class, module:Class; the module also exports its EngineConfig")
    mm.add_argument("--json", default=None, help="write {mode: metrics} here")
    mm.add_argument("--trainer", default="megatron", choices=["megatron", "deepspeed"],
                    help="the trainer backend whose forward is compared (deepspeed: needs --hf)")


def _add_config_parsers(sub) -> None:
    """The subcommands that read a run's configuration (--config, --set)."""
    helps = {"train": "the embedded default: SFT warm-up, then GRPO with FP4 TRACE rollouts",
             "sft": "the supervised warm-up alone; `train` with the same output_dir continues with RL",
             "plan": "per-GPU memory and per-step traffic of a run; refuses a layout that does not fit",
             "slurm": "the run's sbatch script, rendered from its config",
             "config": "the resolved configuration as YAML (defaults, --config, --set)"}
    parsers = {}
    for name, text in helps.items():
        p = parsers[name] = sub.add_parser(name, help=text)
        p.add_argument("--config", default=None, help="YAML file {section: {key: value}}")
        p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one config key")
    parsers["plan"].add_argument("--search", action="store_true",
                                 help="every TP/EP/PP layout of the trainer GPUs, the best first")
    parsers["plan"].add_argument("--json", default=None, help="write the plan(s) here")
    parsers["slurm"].add_argument("--out", default=None, help="write the script here (default: print it)")
    parsers["slurm"].add_argument("--force", action="store_true", help="render even when the plan does not fit")
    parsers["config"].add_argument("--reference", action="store_true",
                                   help="print the schema's reference (docs/configuration.md)")


COMMANDS = {"mismatch": mismatch_main, "train": train_main, "sft": train_main, "audit": audit_main,
            "plan": lambda args: sys.exit(plan_main(args)), "slurm": slurm_main, "config": config_main}


def main(argv: list[str] | None = None) -> None:
    """The `trace-rl` command line (argv: without the program name; default sys.argv[1:])."""
    ap = argparse.ArgumentParser(prog="trace-rl", description="TRACE: FP4 RL of MoE models")
    sub = ap.add_subparsers(dest="command", required=True)
    _add_mismatch_parser(sub)
    _add_config_parsers(sub)
    add_audit_parser(sub)
    args = ap.parse_args(argv)
    torch.manual_seed(getattr(args, "seed", 0))
    COMMANDS[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
