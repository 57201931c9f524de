"""Test set-up shared by every test.

Without a GPU the Triton kernels run under Triton's interpreter; the variable must be set
before `trace_kernels` defines its kernels, which is why it is set here, at import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
