"""`trace-convert-megatron-to-hf`: the same main as the console entry point
(see megatron_trace/checkpoint/cli.py)."""

from megatron_trace.checkpoint.cli import convert_megatron_main

if __name__ == "__main__":
    convert_megatron_main()
