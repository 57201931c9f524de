"""Killing a `trace-rl train` command at a checkpoint, as a crash would, for resume tests."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil


def kill_at_checkpoint(cmd: list[str], run_dir: Path, checkpoint: str, env: dict, timeout_s: float = 300) -> list:
    """Start `cmd`, SIGKILL it (no cleanup of any kind) once `run_dir`/checkpoints/latest names
    `checkpoint`; return the processes it had started that are still alive 10 s later."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.time() + timeout_s
    while not (latest.exists() and latest.read_text().strip() == checkpoint) and proc.poll() is None:
        assert time.time() < deadline, f"the run never reached its {checkpoint} checkpoint"
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(children, timeout=10)
    return alive
