"""SLURM: sbatch scripts rendered from the run's config, SLURM's variables mapped to
torch.distributed's, and a fake two-node job (tests/launch/fake_slurm: srun and scontrol
stand-ins starting one process group per node on this machine) running `trace-rl train`
disaggregated over gloo, then losing a rank."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_trace.config import load_config
from megatron_trace.rl.slurm import expand_hostlist, tasks_per_node_list, torch_env_from_slurm

ROOT = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).resolve().parent / "fake_slurm"


def test_expand_hostlist():
    assert expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_hostlist("node7") == ["node7"]
    assert expand_hostlist("a[8-10]") == ["a8", "a9", "a10"]
    with pytest.raises(ValueError, match="bad range"):
        expand_hostlist("gpu[x-2]")


def test_torch_env_from_slurm():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "gpu[04-05]", "SLURM_JOB_ID": "1234"}
    assert torch_env_from_slurm(env) == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
                                         "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "gpu04",
                                         "MASTER_PORT": str(29500 + 234)}
    assert torch_env_from_slurm(env | {"RANK": "0"}) == {}  # torchrun set them
    assert torch_env_from_slurm({}) == {}
    with pytest.raises(ValueError, match="SLURM_NNODES"):
        torch_env_from_slurm({k: v for k, v in env.items() if k != "SLURM_NNODES"})
    # engine nodes run fewer tasks (an engine rank per dist.engine_tp GPUs): 8 + 8 + 4 tasks
    uneven = env | {"SLURM_NTASKS": "20", "SLURM_NNODES": "3", "SLURM_PROCID": "17", "SLURM_LOCALID": "1",
                    "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "8(x2),4"}
    got = torch_env_from_slurm(uneven)
    assert (got["LOCAL_WORLD_SIZE"], got["GROUP_WORLD_SIZE"], got["WORLD_SIZE"]) == ("4", "3", "20")
    assert tasks_per_node_list("8(x2),4") == [8, 8, 4] and tasks_per_node_list("3") == [3]
    with pytest.raises(ValueError, match="do not make SLURM_NTASKS=20"):
        torch_env_from_slurm(uneven | {"SLURM_STEP_TASKS_PER_NODE": "8(x3)"})
    with pytest.raises(ValueError, match="not the same on each of 3 nodes"):
        torch_env_from_slurm({k: v for k, v in uneven.items() if k != "SLURM_STEP_TASKS_PER_NODE"})


SHAPES = {
    "colocated": [],
    "one-node": ["--set", "dist.engine_ranks=2", "--set", "cluster.gpus_per_node=8", "--set", "dist.ep=2"],
    "multi-node": ["--set", "cluster.nodes=4", "--set", "cluster.engine_nodes=1", "--set", "cluster.gpus_per_node=8",
                   "--set", "dist.ep=4",
                   "--set", "cluster.partition=batch", "--set", "cluster.account=rl", "--set",
                   "cluster.container=nvcr.io/nvidia/pytorch:25.01-py3", "--set", "cluster.nccl_ifname=ib0",
                   "--set", "cluster.setup=source /opt/venv/bin/activate"],
    # 2 trainer nodes + 1 node of SGLang engines of 2 GPUs: 8 + 8 + 4 tasks, placed by a host list
    "engine-nodes": ["--set", "rollout.backend=sglang", "--set", "dist.engine_tp=2", "--set", "cluster.nodes=3",
                     "--set", "cluster.engine_nodes=1", "--set", "cluster.gpus_per_node=8", "--set", "dist.ep=4"],
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sbatch_scripts_render_from_the_config_and_parse(tmp_path, shape):
    out = tmp_path / "job.sbatch"
    run = subprocess.run([sys.executable, "-m", "megatron_trace.cli", "slurm", "--config",
                          str(ROOT / "launch" / "configs" / "tiny.yaml"), *SHAPES[shape], "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    text = out.read_text()
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    cfg = load_config(str(ROOT / "launch" / "configs" / "tiny.yaml"), SHAPES[shape][1::2])
    nodes, per_node = (1, 1) if shape == "colocated" else (cfg.cluster.nodes, cfg.cluster.gpus_per_node)
    assert f"#SBATCH --nodes={nodes}\n" in text and f"#SBATCH --ntasks-per-node={per_node}\n" in text
    engines = {"colocated": 0, "one-node": 2, "multi-node": 8, "engine-nodes": 4}[shape]
    assert f"--set dist.engine_ranks={engines}" in text  # the script passes the config's layout, not its own
    assert str(ROOT / "launch" / "configs" / "tiny.yaml") in text and "--kill-on-bad-exit=1" in text
    assert ("--distribution=arbitrary --ntasks=20" in text) == (shape == "engine-nodes")
    if shape == "engine-nodes":
        assert "awk -v t=2 -v a=8 -v b=4" in text and "export SLURM_HOSTFILE=" in text
    if shape == "multi-node":
        assert all(s in text for s in ("#SBATCH --partition=batch", "#SBATCH --account=rl", "--container-image=",
                                       "NCCL_SOCKET_IFNAME=ib0", "source /opt/venv/bin/activate"))


def test_submit_script_plans_renders_and_submits(tmp_path):
    env = dict(os.environ, PATH=f"{FAKE}:{os.environ['PATH']}", TRACE_JOBS=str(tmp_path), PYTHON=sys.executable)
    run = subprocess.run(["bash", str(ROOT / "launch" / "slurm" / "submit.sh"),
                          str(ROOT / "launch" / "configs" / "qwen3-30b-a3b.yaml")], env=env, capture_output=True,
                         text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "FITS" in run.stdout and "Submitted batch job" in run.stdout
    (script,) = tmp_path.glob("qwen3-30b-a3b-*.sbatch")
    assert "#SBATCH --ntasks-per-node=8" in script.read_text() and "dist.engine_ranks=2" in script.read_text()


@pytest.mark.parametrize("config, srun", [
    # 8 trainer nodes of 8 tasks, 2 engine nodes of 2 SGLang engine ranks (TP4 each)
    ("qwen3-235b-a22b", "--distribution=arbitrary --ntasks=68"),
    # one node: 6 trainer ranks + 1 SGLang engine rank of 2 GPUs (EP2) = 7 tasks on 8 GPUs
    ("qwen3-30b-a3b-sglang-ep", "--ntasks-per-node=7"),
    # 32 trainer nodes of 8 tasks, 4 engine nodes of 1 SGLang engine rank (TP8 each)
    ("deepseek-v3", "--distribution=arbitrary --ntasks=260"),
])
def test_the_sglang_example_configs_plan_and_render(tmp_path, config, srun):
    path = str(ROOT / "launch" / "configs" / f"{config}.yaml")
    plan = subprocess.run([sys.executable, "-m", "megatron_trace.cli", "plan", "--config", path], capture_output=True,
                          text=True, cwd=ROOT)
    assert plan.returncode == 0 and "FITS" in plan.stdout, plan.stdout
    assert "SGLang KV pool: mem_fraction_static" in plan.stdout
    out = tmp_path / "job.sbatch"
    run = subprocess.run([sys.executable, "-m", "megatron_trace.cli", "slurm", "--config", path, "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]  # no --force: engine TP runs on SGLang engines
    text = out.read_text()
    assert srun in text and "#SBATCH --gpus-per-node=8" in text
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    assert f"--set dist.engine_ranks={ {'qwen3-235b-a22b': 4, 'deepseek-v3': 4}.get(config, 1)}" in text


def test_a_layout_that_disagrees_with_the_cluster_is_refused():
    run = subprocess.run([sys.executable, "-m", "megatron_trace.cli", "slurm", "--config",
                          str(ROOT / "launch" / "configs" / "tiny.yaml"), "--set", "cluster.nodes=2", "--set",
                          "cluster.engine_nodes=1", "--set", "dist.engine_ranks=3"], capture_output=True, text=True,
                         cwd=ROOT)
    assert run.returncode != 0 and "dist.engine_ranks=3 disagrees" in run.stderr


def _job(tmp_path, steps, extra=()):
    """Render the two-node job (node 0: 2 trainer ranks, EP2; node 1: 2 engine ranks) and start
    it as sbatch would, with the fake srun and scontrol on PATH."""
    cfg = yaml.safe_load((ROOT / "launch" / "configs" / "tiny.yaml").read_text())
    cfg["sft"] = {"steps": 10}
    cfg["rl"] |= {"steps": steps, "prompts_per_step": 4}
    cfg["dist"] = {"ep": 2}
    cfg["cluster"] = {"nodes": 2, "engine_nodes": 1, "gpus_per_node": 2, "log_dir": str(tmp_path / "logs"),
                      "setup": "export TRACE_SETUP_RAN=1"}
    cfg["output_dir"] = str(tmp_path / "run")
    cfg["checkpoint"] = {"every": 0}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    render = subprocess.run([sys.executable, "-m", "megatron_trace.cli", "slurm", "--config",
                             str(tmp_path / "cfg.yaml"), *extra, "--out", str(tmp_path / "job.sbatch")],
                            capture_output=True, text=True, cwd=ROOT)
    assert render.returncode == 0, render.stderr[-2000:]
    env = dict(os.environ, PATH=f"{FAKE}:{os.environ['PATH']}", SLURM_JOB_NODELIST="127.0.0.1,localhost",
               SLURM_NNODES="2", SLURM_JOB_ID="4242", SLURM_JOB_NAME="trace-test", OMP_NUM_THREADS="1",
               TRITON_INTERPRET="1", PYTHON=sys.executable, FAKE_SRUN_PIDS=str(tmp_path / "pids"),
               MASTER_PORT=str(20000 + os.getpid() % 20000))
    return subprocess.Popen(["bash", str(tmp_path / "job.sbatch")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)


STUB = """#!{python}
# stands in for `python -m megatron_trace.cli train`: where this task's rank and GPUs would be
import json, os, sys
from megatron_trace.config import load_config
from megatron_trace.rl.bridge import Roles
from megatron_trace.rl.job_layout import rank_gpus
from megatron_trace.rl.slurm import torch_env_from_slurm
env = torch_env_from_slurm(dict(os.environ))
os.environ.update(env)
args = sys.argv[1:]
cfg = load_config(args[args.index("--config") + 1], [a for i, a in enumerate(args) if i and args[i - 1] == "--set"])
roles = Roles.from_env(cfg.dist.engine_ranks)
gpus = rank_gpus(roles.rank, int(env["LOCAL_RANK"]), roles.trainers, 1 if roles.is_trainer else cfg.dist.engine_tp)
print(json.dumps(dict(env, node=os.environ["SLURM_NODEID"], trainer=roles.is_trainer, gpus=gpus)), flush=True)
"""


def test_a_fake_job_places_engine_ranks_of_several_gpus_on_the_engine_nodes(tmp_path):
    """The rendered script of 1 trainer node + 1 node of SGLang engines of 2 GPUs (4 GPUs a node),
    run with the fake srun: node 0 runs 4 trainer tasks on GPUs 0-3, node 1 two engine tasks on
    GPUs 0-1 and 2-3, one srun step of 6 ranks, each with its node's task count."""
    cfg = yaml.safe_load((ROOT / "launch" / "configs" / "tiny.yaml").read_text())
    cfg["rollout"] = {"backend": "sglang"}
    cfg["dist"] = {"engine_tp": 2}
    cfg["cluster"] = {"nodes": 2, "engine_nodes": 1, "gpus_per_node": 4, "log_dir": str(tmp_path / "logs")}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    render = subprocess.run([sys.executable, "-m", "megatron_trace.cli", "slurm", "--config",
                             str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "job.sbatch")],
                            capture_output=True, text=True, cwd=ROOT)
    assert render.returncode == 0, render.stderr[-2000:]
    stub = tmp_path / "python"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{FAKE}:{os.environ['PATH']}", SLURM_JOB_NODELIST="127.0.0.1,localhost",
               SLURM_NNODES="2", SLURM_JOB_ID="4243", SLURM_JOB_NAME="trace-test", PYTHON=str(stub))
    job = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    tasks = [json.loads(line) for p in sorted((tmp_path / "logs").glob("*node*.log"))
             for line in p.read_text().splitlines() if line.startswith("{")]
    got = sorted((int(t["RANK"]), t["node"], t["LOCAL_RANK"], t["LOCAL_WORLD_SIZE"], t["trainer"], t["gpus"])
                 for t in tasks)
    assert got == [(0, "0", "0", "4", True, [0]), (1, "0", "1", "4", True, [1]), (2, "0", "2", "4", True, [2]),
                   (3, "0", "3", "4", True, [3]), (4, "1", "0", "2", False, [0, 1]), (5, "1", "1", "2", False, [2, 3])]
    assert all(t["WORLD_SIZE"] == "6" and t["GROUP_WORLD_SIZE"] == "2" for t in tasks)


def test_a_fake_two_node_job_trains(tmp_path):
    job = _job(tmp_path, 2)
    out, err = job.communicate(timeout=900)
    assert job.returncode == 0, (out + err)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["k3_kl"] < 1e-9 for r in rows)
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["trace-test-4242-node0.log", "trace-test-4242-node1.log"], logs
    assert "rendezvous 127.0.0.1:" in out  # the first host of the node list, from scontrol


def test_killing_one_rank_ends_the_job_with_a_clear_message(tmp_path):
    job = _job(tmp_path, 200)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline and job.poll() is None:
        time.sleep(1)
    assert job.poll() is None, job.communicate()[1][-3000:]
    pids = dict(line.split() for line in (tmp_path / "pids").read_text().splitlines())
    os.kill(int(pids["1"]), signal.SIGKILL)  # trainer rank 1, mid-training
    t0 = time.time()
    out, err = job.communicate(timeout=120)  # no hang: every rank is gone well before this
    assert job.returncode != 0 and time.time() - t0 < 60
    assert "task 1: killed by signal 9" in err, err[-3000:]  # srun names the rank that died
    logs = "".join(p.read_text() for p in (tmp_path / "logs").iterdir())
    assert "lost contact with another rank" in logs, logs[-3000:]  # and the survivors say why they stop
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
