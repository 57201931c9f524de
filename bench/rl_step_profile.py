"""Where an RL step's host time goes: `trace-rl train` under cProfile, its hottest functions.

    python bench/rl_step_profile.py --out /tmp/prof -- --set model.preset=demo --set rl.steps=2 ...

Everything after `--` is passed to `trace-rl train`. Writes <out>/rl_step.prof (pstats) and
<out>/rl_step_profile.txt: the per-step split from metrics.jsonl, then the functions with the
most own time and the most cumulative time (TRACE's and its dependencies'). On a GPU, time spent
waiting for kernels shows up where the host synchronises (`.item()`, `.cpu()`, `float(t)`).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("train_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = [x for x in a.train_args if x != "--"]
    a.out.mkdir(parents=True, exist_ok=True)
    run_dir = a.out / "run"
    from megatron_trace.quiet import trace_rl

    sys.argv = ["trace-rl", "train", *args, "--set", f"output_dir={run_dir}"]
    prof = cProfile.Profile()
    try:
        prof.runcall(trace_rl)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    prof.dump_stats(a.out / "rl_step.prof")
    text = io.StringIO()
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        text.write("step {step}: rollout {rollout_s:.2f} s, train {train_s:.2f} s, sync {sync_s:.2f} s, "
                   "{tokens} tokens\n".format(**m))
    for key in ("tottime", "cumulative"):
        stats = pstats.Stats(prof, stream=text)
        stats.strip_dirs().sort_stats(key).print_stats(a.top)
    (a.out / "rl_step_profile.txt").write_text(text.getvalue())
    print(text.getvalue())


if __name__ == "__main__":
    main()
