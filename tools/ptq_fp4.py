"""`trace-ptq-fp4`: the same main as the console entry point
(see megatron_trace/checkpoint/cli.py)."""

from megatron_trace.checkpoint.cli import ptq_main

if __name__ == "__main__":
    ptq_main()
