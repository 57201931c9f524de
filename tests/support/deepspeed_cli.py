"""`python -m tests.support.deepspeed_cli ARGS`: `trace-rl ARGS` with DeepSpeed's CPU test shims
(tests/support/deepspeed_cpu.py: no shm_comm op build, no JIT compile), for tests that start
`trace-rl` under torchrun with trainer.backend=deepspeed. Test harness only."""

import sys

from tests.support import deepspeed_cpu

if __name__ == "__main__":
    deepspeed_cpu.cpu_environment()
    deepspeed_cpu.patch_deepspeed()
    from megatron_trace.cli import main

    main(sys.argv[1:])
