"""SLURM: the sbatch script of a run, rendered from its config, and the torch.distributed
environment of one `srun` task.

`render_sbatch` writes one script for the run the config describes: `cluster.nodes` nodes of
`cluster.gpus_per_node` GPUs, one task per GPU, the last `cluster.engine_nodes` nodes serving
rollouts (disaggregated; 0 with dist.engine_ranks=0: colocated, one GPU). The trainer layout
(dist.tp/ep/pp/etp) is the config's own, and the script passes the config file itself to every
task, so the script and the run cannot disagree. `trace-rl plan` checks the layout first.

Under `srun` each task maps SLURM's variables to the ones torch.distributed reads
(`torch_env_from_slurm`): RANK = SLURM_PROCID, WORLD_SIZE = SLURM_NTASKS, LOCAL_RANK =
SLURM_LOCALID, MASTER_ADDR = the first host of SLURM_JOB_NODELIST. `launch/local.sh` runs the
same `trace-rl train` under torchrun, which sets those itself.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

DEFAULT_PORT = 29500


def expand_hostlist(spec: str) -> list[str]:
    """SLURM's compressed host list ("gpu[01-03,07],login1") as host names, in order."""
    hosts, i = [], 0
    for m in re.finditer(r"([^,\[]+)(\[([^\]]*)\])?(,|$)", spec.strip()):
        i = m.end()
        prefix, ranges = m.group(1), m.group(3)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"SLURM host list {spec!r}: bad range {part!r}")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{len(lo)}d}")
    if not hosts or i != len(spec.strip()):
        raise ValueError(f"SLURM host list {spec!r} could not be read")
    return hosts


def torch_env_from_slurm(env: dict) -> dict:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT of this srun
    task ({} outside SLURM or when torchrun already set them). MASTER_PORT: the job's, else
    29500 plus the job id modulo 1000 (two jobs on one node do not collide)."""
    if "SLURM_PROCID" not in env or "RANK" in env:
        return {}
    missing = [k for k in ("SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_NNODES") if k not in env]
    if missing:
        raise ValueError(f"an srun task without {', '.join(missing)}: start it with srun, one task per GPU")
    world, nodes = int(env["SLURM_NTASKS"]), int(env["SLURM_NNODES"])
    if world % nodes:
        raise ValueError(f"SLURM_NTASKS={world} is not the same on each of {nodes} nodes (use --ntasks-per-node)")
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(world), "LOCAL_RANK": env["SLURM_LOCALID"],
            "LOCAL_WORLD_SIZE": str(world // nodes),
            "MASTER_ADDR": env.get("MASTER_ADDR") or expand_hostlist(env["SLURM_JOB_NODELIST"])[0],
            "MASTER_PORT": env.get("MASTER_PORT") or str(DEFAULT_PORT + int(env.get("SLURM_JOB_ID", 0)) % 1000)}


def job_shape(cfg) -> tuple[int, int, int]:
    """(nodes, tasks per node, engine ranks) of the run's SLURM job."""
    cl = cfg.cluster
    if cl.engine_nodes == 0 and cfg.dist.engine_ranks == 0:
        if cl.nodes != 1:
            raise ValueError("config: a colocated run (cluster.engine_nodes=0, dist.engine_ranks=0) is one process "
                             "on one GPU: set cluster.nodes=1, or cluster.engine_nodes for a disaggregated run")
        return 1, 1, 0
    engines = cl.engine_nodes * cl.gpus_per_node if cl.engine_nodes else cfg.dist.engine_ranks
    if cfg.dist.engine_ranks not in (0, engines):
        raise ValueError(f"config: dist.engine_ranks={cfg.dist.engine_ranks} disagrees with cluster.engine_nodes x "
                         f"gpus_per_node = {engines}")
    if not cl.engine_nodes and cl.nodes > 1:
        raise ValueError("config: on several nodes the engines take whole nodes: set cluster.engine_nodes")
    return cl.nodes, cl.gpus_per_node, engines


def render_sbatch(cfg, config_path: str, overrides: list[str] = (), workdir: str | None = None) -> str:
    """The sbatch script that runs `trace-rl train --config config_path --set ...` as `cfg`
    (that file plus those overrides, already validated) describes."""
    cl, d = cfg.cluster, cfg.dist
    nodes, per_node, engines = job_shape(cfg)
    trainers = nodes * per_node - engines
    q = shlex.quote
    sbatch = [f"--job-name=trace-rl-{Path(cfg.output_dir).name}", f"--nodes={nodes}", f"--ntasks-per-node={per_node}",
              f"--gpus-per-node={per_node}", f"--time={cl.time}", f"--output={cl.log_dir}/%x-%j.out"]
    sbatch += ["--exclusive"] * (nodes > 1)
    sbatch += [f"--partition={cl.partition}"] * bool(cl.partition) + [f"--account={cl.account}"] * bool(cl.account)
    args = ["-m", "megatron_trace.cli", "train", "--config", str(Path(config_path).resolve()),
            *[a for o in overrides for a in ("--set", o)], "--set", f"dist.engine_ranks={engines}"]
    srun = ["srun", "--kill-on-bad-exit=1", "--wait=120", f"--ntasks-per-node={per_node}",
            f"--output={cl.log_dir}/%x-%j-node%n.log"]
    if cl.container:
        srun += [f"--container-image={cl.container}", f"--container-workdir={workdir or Path.cwd()}",
                 "--container-mounts=" + q(str(Path(workdir or Path.cwd())))]
    lines = ["#!/bin/bash", *(f"#SBATCH {s}" for s in sbatch),
             f"# Generated by `trace-rl slurm` from {config_path}"
             + (f" with {' '.join(overrides)}" if overrides else "") + ". Regenerate it; do not edit.",
             f"# {nodes} node(s) x {per_node} GPU(s): {trainers} trainer rank(s) (TP{d.tp} EP{d.ep} PP{d.pp} "
             f"ETP{d.etp}, the rest data parallel), {engines} engine rank(s) on the last "
             f"{cl.engine_nodes} node(s).",
             "set -euo pipefail",
             f"cd {q(str(workdir or Path.cwd()))}",
             f"mkdir -p {q(cl.log_dir)}"]
    if cl.setup:
        lines += ["# environment (cluster.setup)", cl.setup]
    lines += [
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 1000))}',
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1  # a rank that loses a peer aborts instead of hanging",
    ]
    if cl.nccl_ifname:
        lines.append(f"export NCCL_SOCKET_IFNAME={q(cl.nccl_ifname)}")
    if cl.gloo_ifname:
        lines.append(f"export GLOO_SOCKET_IFNAME={q(cl.gloo_ifname)}")
    lines += ['echo "trace-rl: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR:$MASTER_PORT"',
              "# one task per GPU; if one fails, srun ends the others (--kill-on-bad-exit)",
              " ".join(srun) + " \\",
              "    ${PYTHON:-python} " + " ".join(q(a) for a in args), ""]
    return "\n".join(lines)
