"""Known, harmless notices of optional packages silenced by message for the command line (a
library import changes no filters): every other warning still shows.

Each entry names why it is harmless here. `silence_known_notices()` must run before megatron-core
is imported: most of these fire at its import.
"""

from __future__ import annotations

import logging
import re
import warnings

# (category, message regex): Python warnings
KNOWN_WARNINGS = [
    # TRACE uses megatron-core's local spec and torch optimizers on purpose (TE is a separate front end)
    (UserWarning, r"Transformer Engine and Apex are not installed"),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm"),
    (UserWarning, r"full scope is deprecated\. Use empty cuda_graph_modules"),  # megatron's own default
    (UserWarning, r"MimoModelConfig is experimental"),  # imported by megatron-core, unused
    # the CPU harness: BF16 activations with FP32 norm weights, and the grad attribute its patch reads
    (UserWarning, r"Mismatch dtype between input and weight"),
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
    # torch.distributed.checkpoint under megatron-core's dist checkpoints (one process; its API drift)
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized"),
    (UserWarning, r"The argument order of load has been changed"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
    # trainer.transformer_impl=transformer_engine under sequence parallelism: TE gathers the input of
    # a custom recipe's quantizer in BF16 and quantizes after, which TRACE's sites expect (docs/trainer.md)
    (UserWarning, r"Attempting to all-gather an unsupported quantized tensor\. Falling back to high-precision"),
    # gloo collectives megatron-core calls by their old names
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"),
]
# megatron-core log records (logger "megatron"): notices about APIs TRACE does not use
KNOWN_LOG_MESSAGES = [
    r"GPTModel IS DEPRECATED",
    r"DistributedDataParallel: full_param_layout not provided",  # DDP computes the layout itself
    r"MCore's async save is deprecated",  # logged by every torch_dist save; TRACE saves synchronously
]


class _KnownMessages(logging.Filter):
    def __init__(self, patterns: list[str]):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def silence_known_notices() -> None:
    """Install the filters: Python warnings by category and message, megatron-core's log records by
    message (through one stderr handler on the "megatron" logger, so its other records still show)."""
    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    log = logging.getLogger("megatron")
    if not any(isinstance(f, _KnownMessages) for h in log.handlers for f in h.filters):
        handler = logging.StreamHandler()
        handler.addFilter(_KnownMessages(KNOWN_LOG_MESSAGES))
        log.addHandler(handler)
        log.propagate = False


def trace_rl() -> None:
    """The `trace-rl` console script: the known notices silenced, then `cli.main`."""
    import sys

    silence_known_notices()
    from .cli import main

    main(sys.argv[1:])
