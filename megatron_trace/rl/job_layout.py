"""A job's ranks and their GPUs: trainer ranks, engine ranks, and the GPUs of each.

One process per rank, not per GPU. A trainer rank holds one GPU. An engine rank runs one engine
of `dist.engine_tp` GPUs (SGLang's tp_size; the built-in engine runs on one). On every node the
trainer ranks take the first GPUs, one each in local-rank order, and the engine ranks take the
GPUs after them, `dist.engine_tp` consecutive GPUs each:

    local GPUs of a node with t trainer ranks:  0 .. t-1 (trainers), then engine j: t + j*N .. t + (j+1)*N - 1

So `launch/local.sh` (one node) starts TRAINERS + ENGINES processes on TRAINERS + ENGINES x
engine_tp GPUs, and a SLURM job runs `cluster.gpus_per_node` trainer tasks on a trainer node and
`gpus_per_node / engine_tp` engine tasks on an engine node (`job_shape`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JobShape:
    """A run's ranks as its `cluster` and `dist` sections lay them out."""

    trainers: int  # trainer ranks, one GPU each
    engine_ranks: int  # engine ranks, engine_tp GPUs each (0: colocated)
    engine_tp: int
    tasks_per_node: tuple[int, ...]  # processes per node, the trainer nodes first

    @property
    def nodes(self) -> int:
        return len(self.tasks_per_node)

    @property
    def engine_gpus(self) -> int:
        return self.engine_ranks * self.engine_tp

    @property
    def world(self) -> int:
        return sum(self.tasks_per_node)

    @property
    def uniform(self) -> bool:
        """Every node runs as many tasks as every other (srun --ntasks-per-node suffices)."""
        return len(set(self.tasks_per_node)) == 1


def job_shape(cfg) -> JobShape:
    """The run's shape from `cluster` and `dist` (a TrainConfig): colocated (one process, one GPU),
    one node of trainer and engine ranks (`dist.engine_ranks`), or whole engine nodes
    (`cluster.engine_nodes`, each holding gpus_per_node / engine_tp engine ranks). ValueError
    naming the settings when they disagree or the GPUs do not divide into engines."""
    cl, d = cfg.cluster, cfg.dist
    g, n = cl.gpus_per_node, d.engine_tp
    if cl.engine_nodes == 0 and d.engine_ranks == 0:
        return JobShape(1, 0, n, (1,))
    if cl.engine_nodes:
        if g % n:
            raise ValueError(f"config: cluster.gpus_per_node={g} does not divide into engines of dist.engine_tp={n} "
                             "GPUs (an engine node runs gpus_per_node / engine_tp engine ranks)")
        engines = cl.engine_nodes * g // n
        if d.engine_ranks not in (0, engines):
            raise ValueError(f"config: dist.engine_ranks={d.engine_ranks} disagrees with cluster.engine_nodes x "
                             f"gpus_per_node / dist.engine_tp = {cl.engine_nodes} x {g} / {n} = {engines} engine "
                             "ranks")
        trainer_nodes = cl.nodes - cl.engine_nodes
        return JobShape(trainer_nodes * g, engines, n, (g,) * trainer_nodes + (g // n,) * cl.engine_nodes)
    engines = d.engine_ranks
    trainers = cl.nodes * g - engines * n
    if trainers < 1:
        raise ValueError(f"config: dist.engine_ranks x dist.engine_tp = {engines} x {n} engine GPUs leave no trainer "
                         f"GPU of cluster.nodes x gpus_per_node = {cl.nodes} x {g}")
    # several nodes without engine nodes: only the plan counts them (the SLURM script refuses)
    tasks = (trainers + engines,) if cl.nodes == 1 else (g,) * cl.nodes
    return JobShape(trainers, engines, n, tasks)


def engine_instances(cfg, engine_tp: int | None = None) -> int:
    """Engines sharing a step's groups: the engine ranks (1 when colocated). With another
    `engine_tp` than dist.engine_tp, the engines the same engine GPUs would make."""
    cl, d = cfg.cluster, cfg.dist
    n = engine_tp or d.engine_tp
    if cl.engine_nodes:
        gpus = cl.engine_nodes * cl.gpus_per_node
    elif d.engine_ranks:
        gpus = d.engine_ranks * d.engine_tp
    else:
        return 1
    return max(1, gpus // n)


def rank_gpus(rank: int, local_rank: int, trainers: int, engine_tp: int) -> list[int]:
    """The local GPU indices of global rank `rank` (local rank `local_rank` on its node) in a job
    whose first `trainers` ranks train (see the module docstring). The ranks of a node are
    consecutive global ranks, as torchrun and SLURM's block and listed (arbitrary) layouts place them."""
    if rank < trainers:
        return [local_rank]
    first_of_node = rank - local_rank
    local_trainers = min(max(trainers - first_of_node, 0), local_rank)
    start = local_trainers + (local_rank - local_trainers) * engine_tp
    return list(range(start, start + engine_tp))


def check_local_gpus(gpus: list[int], device_count: int, engine_tp: int, is_engine: bool) -> None:
    """ValueError naming the settings when an engine of several GPUs would need GPUs this node
    lacks (an engine of one GPU may share one, as the built-in engine does on small machines)."""
    if is_engine and engine_tp > 1 and gpus[-1] >= device_count:
        raise ValueError(f"dist.engine_tp={engine_tp}: this engine rank's engine needs GPUs {gpus[0]}-{gpus[-1]} "
                         f"of this node (after its trainer ranks' GPUs and the other engine ranks'), and it has "
                         f"{device_count}: lower dist.engine_ranks or dist.engine_tp, or start fewer trainer ranks")


PLACED_BY_TRACE = ("base_gpu_id", "gpu_id_step")  # SGLang's GPU placement, which job_layout decides


def check_engine_settings(cfg) -> None:
    """The engine settings of a run, checked at start (ValueError naming them): the cluster's
    engine nodes divide into engines of dist.engine_tp GPUs and agree with dist.engine_ranks, and
    SGLang's GPU placement is left to TRACE on engine ranks."""
    if cfg.cluster.engine_nodes:
        job_shape(cfg)
    if cfg.rollout.backend == "sglang" and cfg.dist.engine_ranks:
        placed = sorted(set(PLACED_BY_TRACE) & set(cfg.rollout.sglang))
        if placed:
            raise ValueError(f"rollout.sglang: {placed}: TRACE gives each engine rank its own dist.engine_tp GPUs "
                             "(after the trainer ranks' GPUs of its node); leave SGLang's GPU placement unset")
