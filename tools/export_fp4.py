"""`trace-export-fp4`: the same main as the console entry point
(see megatron_trace/checkpoint/cli.py)."""

from megatron_trace.checkpoint.cli import export_main

if __name__ == "__main__":
    export_main()
