"""SLURM: the sbatch script of a run, rendered from its config, and the torch.distributed
environment of one `srun` task.

`render_sbatch` writes one script for the run the config describes: `cluster.nodes` nodes of
`cluster.gpus_per_node` GPUs, the last `cluster.engine_nodes` nodes serving rollouts
(disaggregated; 0 with dist.engine_ranks=0: colocated, one GPU). One task per rank
(`job_layout`): a trainer node runs one task per GPU, an engine node one task per engine
(gpus_per_node / dist.engine_tp); when the nodes' task counts differ, srun places the tasks by
a host list (`--distribution=arbitrary`, `SLURM_HOSTFILE`), so that ranks stay one srun step:
`--kill-on-bad-exit` ends every rank when one fails. The trainer layout (dist.tp/ep/pp/etp) is
the config's own, and the script passes the config file itself to every task, so the script and
the run cannot disagree. `trace-rl plan` checks the layout first.

Under `srun` each task maps SLURM's variables to the ones torch.distributed reads
(`torch_env_from_slurm`): RANK = SLURM_PROCID, WORLD_SIZE = SLURM_NTASKS, LOCAL_RANK =
SLURM_LOCALID, LOCAL_WORLD_SIZE = this node's tasks, GROUP_WORLD_SIZE = the nodes, MASTER_ADDR =
the first host of SLURM_JOB_NODELIST. `launch/local.sh` runs the same `trace-rl train` under
torchrun, which sets those itself.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from .job_layout import JobShape
from .job_layout import job_shape as layout_of

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


def tasks_per_node_list(spec: str) -> list[int]:
    """SLURM's compressed tasks-per-node list ("8(x2),4" -> [8, 8, 4])."""
    out = []
    for part in spec.split(","):
        count, _, times = part.partition("(x")
        if not count.isdigit() or (times and not times.rstrip(")").isdigit()):
            raise ValueError(f"SLURM tasks per node {spec!r} could not be read")
        out += [int(count)] * (int(times.rstrip(")")) if times else 1)
    return out


def torch_env_from_slurm(env: dict) -> dict:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT of
    this srun task ({} outside SLURM or when torchrun already set them). LOCAL_WORLD_SIZE: this
    node's tasks (SLURM_STEP_TASKS_PER_NODE; nodes may run different counts). MASTER_PORT: the
    job's, else 29500 plus the job id modulo 1000 (two jobs on one node do not collide)."""
    if "SLURM_PROCID" not in env or "RANK" in env:
        return {}
    missing = [k for k in ("SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_NNODES") if k not in env]
    if missing:
        raise ValueError(f"an srun task without {', '.join(missing)}: start it with srun (the script trace-rl slurm "
                         "renders)")
    world, nodes = int(env["SLURM_NTASKS"]), int(env["SLURM_NNODES"])
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if spec and "SLURM_NODEID" in env:
        per_node = tasks_per_node_list(spec)
        if len(per_node) != nodes or sum(per_node) != world:
            raise ValueError(f"SLURM tasks per node {spec!r} do not make SLURM_NTASKS={world} on {nodes} nodes")
        local_world = per_node[int(env["SLURM_NODEID"])]
    elif world % nodes:
        raise ValueError(f"SLURM_NTASKS={world} is not the same on each of {nodes} nodes, and SLURM_NODEID / "
                         "SLURM_STEP_TASKS_PER_NODE do not say how many run here")
    else:
        local_world = world // nodes
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(world), "LOCAL_RANK": env["SLURM_LOCALID"],
            "LOCAL_WORLD_SIZE": str(local_world), "GROUP_WORLD_SIZE": str(nodes),
            "MASTER_ADDR": env.get("MASTER_ADDR") or expand_hostlist(env["SLURM_JOB_NODELIST"])[0],
            "MASTER_PORT": env.get("MASTER_PORT") or str(DEFAULT_PORT + int(env.get("SLURM_JOB_ID", 0)) % 1000)}


def job_shape(cfg) -> JobShape:
    """The run's SLURM job (job_layout.JobShape); ValueError for a layout SLURM cannot run."""
    shape = layout_of(cfg)
    if shape.engine_ranks == 0 and cfg.dist.engine_tp > 1:
        raise ValueError(f"config: dist.engine_tp={cfg.dist.engine_tp} in a colocated run: its job is one process on "
                         "one GPU; an engine of several GPUs runs on engine ranks (cluster.engine_nodes or "
                         "dist.engine_ranks)")
    if shape.engine_ranks == 0 and cfg.cluster.nodes != 1:
        raise ValueError("config: a colocated run (cluster.engine_nodes=0, dist.engine_ranks=0) is one process "
                         "on one GPU: set cluster.nodes=1, or cluster.engine_nodes for a disaggregated run")
    if shape.engine_ranks and not cfg.cluster.engine_nodes and cfg.cluster.nodes > 1:
        raise ValueError("config: on several nodes the engines take whole nodes: set cluster.engine_nodes")
    return shape


def render_sbatch(cfg, config_path: str, overrides: list[str] = (), workdir: str | None = None) -> str:
    """The sbatch script that runs `trace-rl train --config config_path --set ...` as `cfg`
    (that file plus those overrides, already validated) describes."""
    cl, d = cfg.cluster, cfg.dist
    shape = job_shape(cfg)
    nodes, most = shape.nodes, max(shape.tasks_per_node)
    gpus = 1 if shape.engine_ranks == 0 else cl.gpus_per_node
    q = shlex.quote
    sbatch = [f"--job-name=trace-rl-{Path(cfg.output_dir).name}", f"--nodes={nodes}", f"--ntasks-per-node={most}",
              f"--gpus-per-node={gpus}", f"--time={cl.time}", f"--output={cl.log_dir}/%x-%j.out"]
    sbatch += ["--exclusive"] * (nodes > 1)
    sbatch += [f"--partition={cl.partition}"] * bool(cl.partition) + [f"--account={cl.account}"] * bool(cl.account)
    args = ["-m", "megatron_trace.cli", "train", "--config", str(Path(config_path).resolve()),
            *[a for o in overrides for a in ("--set", o)], "--set", f"dist.engine_ranks={shape.engine_ranks}"]
    srun = ["srun", "--kill-on-bad-exit=1", "--wait=120"]
    srun += [f"--ntasks-per-node={most}"] if shape.uniform else ["--distribution=arbitrary", f"--ntasks={shape.world}"]
    srun += [f"--output={cl.log_dir}/%x-%j-node%n.log"]
    if cl.container:
        srun += [f"--container-image={cl.container}", f"--container-workdir={workdir or Path.cwd()}",
                 "--container-mounts=" + q(str(Path(workdir or Path.cwd())))]
    engines = (f"{shape.engine_ranks} engine rank(s) of {shape.engine_tp} GPU(s) each"
               + (f" on the last {cl.engine_nodes} node(s)" if cl.engine_nodes else " after the trainers' GPUs"))
    lines = ["#!/bin/bash", *(f"#SBATCH {s}" for s in sbatch),
             f"# Generated by `trace-rl slurm` from {config_path}"
             + (f" with {' '.join(overrides)}" if overrides else "") + ". Regenerate it; do not edit.",
             f"# {nodes} node(s) x {gpus} GPU(s): {shape.trainers} trainer rank(s) (TP{d.tp} EP{d.ep} PP{d.pp} "
             f"ETP{d.etp}, the rest data parallel), {engines}.",
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
    lines.append('echo "trace-rl: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR:$MASTER_PORT"')
    if shape.uniform:
        lines.append("# one task per rank; if one fails, srun ends the others (--kill-on-bad-exit)")
    else:
        trainer_nodes = cl.nodes - cl.engine_nodes
        lines += [f"# one task per rank: {shape.tasks_per_node[0]} per trainer node, {shape.tasks_per_node[-1]} per "
                  f"engine node (an engine rank runs {shape.engine_tp} GPUs); the host list places them, one srun "
                  "step, so that if one fails srun ends the others (--kill-on-bad-exit)",
                  f"export SLURM_HOSTFILE={q(cl.log_dir)}/hosts-$SLURM_JOB_ID",
                  f'scontrol show hostnames "$SLURM_JOB_NODELIST" | awk -v t={trainer_nodes} '
                  f"-v a={shape.tasks_per_node[0]} -v b={shape.tasks_per_node[-1]} "
                  "'{n = NR <= t ? a : b; for (i = 0; i < n; i++) print}' > \"$SLURM_HOSTFILE\""]
    lines += [" ".join(srun) + " \\",
              "    ${PYTHON:-python} " + " ".join(q(a) for a in args), ""]
    return "\n".join(lines)
