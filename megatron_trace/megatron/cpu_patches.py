"""Monkeypatches that let megatron-core (pinned: 0.19.2) run MoE GPT models on the CPU with gloo.

Test-harness / CPU-launch-path only: the patches replace parts of ``torch.cuda`` and of
megatron-core for the whole process.  megatron-core itself is not modified on disk.  On a machine
with CUDA, :func:`apply_cpu_patches` does nothing.

See docs/notes/megatron-core-on-cpu.md for the background (patch names P1..P7 and P9 follow it; P8 is
from docs/notes/scale-trainer-deepspeed-te.md).
P3 is fixed in 0.19; P5 (norms under sequence parallelism) is not a CPU matter and is solved
in the model itself (`spec.TraceRMSNorm`), so it is not patched here.

Public API::

    apply_cpu_patches()                      # idempotent; no-op when torch.cuda.is_available()
    initialize_model_parallel_cpu(tp=1, pp=1, ep=1, etp=None, seed=1234)
    destroy_model_parallel_cpu()

The caller initialises the default gloo process group itself
(``torch.distributed.init_process_group("gloo", ...)``) before ``initialize_model_parallel_cpu``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

__all__ = ["apply_cpu_patches", "destroy_model_parallel_cpu", "initialize_model_parallel_cpu"]

_APPLIED = False
_CPU = torch.device("cpu")
# Originals of everything replaced, keyed by a readable name (kept for debugging / introspection).
_ORIGINALS: dict[str, Any] = {}
_MODE: _CudaToCpuMode | None = None
# How often the CPU-only code paths of P6/P7 ran (lets tests assert a path was exercised).
PATCH_HITS: dict[str, int] = {}


def _hit(name: str) -> None:
    PATCH_HITS[name] = PATCH_HITS.get(name, 0) + 1


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _replace(owner: Any, name: str, new: Any, key: str | None = None) -> None:
    """setattr(owner, name, new), remembering the original once."""
    key = key or f"{getattr(owner, '__name__', owner)}.{name}"
    if key not in _ORIGINALS:
        _ORIGINALS[key] = getattr(owner, name, None)
    setattr(owner, name, new)


def _is_cuda_like(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare ordinal means a CUDA device in torch
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


# --------------------------------------------------------------------------------------------------
# P1: RNG tracker on the CPU generator
# --------------------------------------------------------------------------------------------------


def _seed_cpu_generator(seed) -> None:
    torch.default_generator.manual_seed(int(seed))


def _patch_p1_rng() -> None:
    """P1: megatron's ``CudaRNGStatesTracker`` and checkpoint recompute save/restore the *CUDA*
    generator (``_get_cuda_rng_state``/``_set_cuda_rng_state``/``torch.cuda.get_rng_state``), which
    does not exist here; on the CPU every random draw (init with use_cpu_initialization, dropout)
    comes from the CPU generator.  Back all of them with the CPU generator, so that
    ``tracker.fork()`` really switches streams and ``tensor_parallel.model_parallel_cuda_manual_seed``
    works unchanged.  ``torch.cuda.manual_seed`` then seeds the CPU generator, as the "default"
    (data-parallel) state does on the GPU."""
    from megatron.core.tensor_parallel import random as mrandom

    def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
        if isinstance(new_state, torch.Generator):
            new_state = new_state.get_state()
        torch.set_rng_state(new_state)

    _replace(mrandom, "_get_cuda_rng_state", _get_cpu_rng_state)
    _replace(mrandom, "_set_cuda_rng_state", _set_cpu_rng_state)

    tracker_cls = mrandom.CudaRNGStatesTracker

    def add(self, name, seed):
        """Track the rng state (CPU generator)."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        orig = torch.get_rng_state()
        _seed_cpu_generator(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Same as megatron's fork, minus the 'CPU RNG state changed within GPU RNG context'
        warning, which would fire on every draw now that both are the same generator."""
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(
                    f"current state name {self._current_state_name} is not the same as the "
                    f"desired state name {name}."
                )
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name

    _replace(tracker_cls, "add", add, "CudaRNGStatesTracker.add")
    _replace(tracker_cls, "fork", fork, "CudaRNGStatesTracker.fork")

    # torch.cuda RNG entry points used by megatron (model_parallel_cuda_manual_seed,
    # rerun_state_machine, fsdp utils).
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly.)
    _replace(torch.cuda, "manual_seed", _seed_cpu_generator)
    _replace(torch.cuda, "manual_seed_all", _seed_cpu_generator)
    _replace(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _replace(torch.cuda, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state))
    _replace(torch.cuda, "get_rng_state_all", lambda: [torch.get_rng_state()])
    _replace(torch.cuda, "set_rng_state_all", lambda states: torch.set_rng_state(states[0]))
    _replace(torch.cuda, "default_generators", (torch.default_generator,))


# --------------------------------------------------------------------------------------------------
# P2: torch.cuda device / stream / event / synchronize
# --------------------------------------------------------------------------------------------------


class _NoopEvent:
    """Stand-in for torch.cuda.Event: everything is synchronous on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def elapsed_time(self, end_event):
        return 0.0


class _NoopStream:
    """Stand-in for torch.cuda.Stream: a single synchronous "stream"."""

    device = _CPU
    device_index = None
    cuda_stream = 0
    priority = 0

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _NoopEvent()

    def synchronize(self):
        return None

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        # All streams are the same CPU "stream" (so megatron's on_side_stream checks are False).
        return isinstance(other, _NoopStream)

    def __hash__(self):
        return 0


_DEFAULT_STREAM = _NoopStream()


def _patch_p2_cuda_runtime() -> None:
    """P2a: megatron calls ``torch.cuda.current_device()`` (router, rotary embedding, mappings,
    layers, attention, global memory buffer, p2p, ...) and passes the answer as ``device=``; answer
    the CPU device so those tensors are CPU tensors.  ``set_device``/``device`` become no-ops and
    ``device_count`` says 1.
    P2b: ``torch.cuda.Stream``/``current_stream``/``default_stream``/``stream``/``set_stream``/
    ``Event`` are used by the alltoall token dispatcher (DtoH side stream), MoE layer and shared
    experts; replace them with synchronous no-ops.
    P2c: ``torch.cuda.synchronize`` (p2p_communication, parallel_state) becomes a no-op."""
    c = torch.cuda
    # P2a
    _replace(c, "current_device", lambda: _CPU)
    _replace(c, "set_device", lambda device: None)
    _replace(c, "device_count", lambda: 1)
    _replace(c, "device", lambda device=None: contextlib.nullcontext())
    # P2b
    _replace(c, "Stream", _NoopStream)
    _replace(c, "Event", _NoopEvent)
    _replace(c, "current_stream", lambda device=None: _DEFAULT_STREAM)
    _replace(c, "default_stream", lambda device=None: _DEFAULT_STREAM)
    _replace(c, "set_stream", lambda stream: None)
    _replace(c, "stream", lambda stream=None: contextlib.nullcontext())
    # P2c
    _replace(c, "synchronize", lambda device=None: None)
    _replace(c, "empty_cache", lambda: None)


# --------------------------------------------------------------------------------------------------
# P4: device="cuda" / device=<int> / .cuda() / .to("cuda") / pin_memory -> CPU
# --------------------------------------------------------------------------------------------------

try:
    from torch.overrides import TorchFunctionMode
except ImportError:  # pragma: no cover - very old torch
    TorchFunctionMode = object  # type: ignore[misc,assignment]


class _CudaToCpuMode(TorchFunctionMode):
    """P4: a process-wide TorchFunctionMode that rewrites CUDA device arguments to the CPU.

    Factory functions (``torch.empty(..., device="cuda")``, ``torch.tensor(..., device=0)``,
    ``x.new_zeros(..., device=...)``), ``Tensor.to("cuda"/0/torch.device("cuda"))``,
    ``Tensor.cuda()``, ``pin_memory=True`` / ``Tensor.pin_memory()`` and ``Tensor.record_stream``
    all go through ``__torch_function__``, so one mode catches them wherever megatron builds them
    (schedules' ``total_num_tokens``, causal masks, optimizer, clip_grads, data broadcast, ...).
    Patching the factory functions one by one would miss ``from torch import ...`` aliases."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func is _TENSOR_CUDA:
            # Tensor.cuda(device=None, non_blocking=False, memory_format=...) -> stay on the CPU.
            return args[0].to(_CPU)
        if func is _TENSOR_PIN_MEMORY:
            return args[0]
        if func is _TENSOR_RECORD_STREAM:
            return None
        if func is _TENSOR_TO and len(args) > 1 and _is_cuda_like(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        if "device" in kwargs and _is_cuda_like(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_TO = torch.Tensor.to
_TENSOR_PIN_MEMORY = torch.Tensor.pin_memory
_TENSOR_RECORD_STREAM = torch.Tensor.record_stream


def _patch_p4_device_mode() -> None:
    """P4: push :class:`_CudaToCpuMode` onto this thread's torch-function-mode stack for good.
    Autograd propagates the mode to backward; threads created later (e.g. dist_checkpointing
    writers) do not get it, but they do not create CUDA tensors."""
    global _MODE
    if _MODE is None:
        _MODE = _CudaToCpuMode()
        _MODE.__enter__()


# --------------------------------------------------------------------------------------------------
# P6: maybe_move_tensor_to_cpu for tensors that are already on the CPU
# --------------------------------------------------------------------------------------------------


def _patch_p6_move_to_cpu() -> None:
    """P6: ``moe_utils.maybe_move_tensor_to_cpu`` only converts CUDA tensors, so on the CPU the
    alltoall dispatcher's ``input_splits``/``output_splits`` (requested ``as_numpy``) stay tensors
    and ``all_to_all_single`` raises TypeError on a tensor split list.  Convert CPU tensors too
    (to numpy when ``as_numpy``, exactly as the CUDA path does: consumers call ``.tolist()``)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    orig = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(orig)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            _hit("p6_move_to_cpu")
            return tensor.numpy() if as_numpy else tensor
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _replace(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    _replace(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


# --------------------------------------------------------------------------------------------------
# P7: uneven all-gather / reduce-scatter on gloo
# --------------------------------------------------------------------------------------------------


def _patch_p7_uneven_collectives() -> None:
    """P7: gloo's allgather requires equal tensor sizes ("ProcessGroupGloo::allgather: invalid
    tensor size"), and we do not rely on its list reduce_scatter for unequal sizes either.
    ``tensor_parallel.mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` get
    uneven ``output_split_sizes``/``input_split_sizes`` from the alltoall dispatcher when
    expert-TP > 1 (``gather_from_sequence_parallel_region`` in dispatch, its backward, and the
    reduce-scatter in combine).  Implement the uneven cases as pad-to-max +
    all_gather_into_tensor + unpad, and all_reduce + slice (autograd is unaffected: both are
    called inside megatron's autograd Functions).  Equal sizes go to the originals unchanged."""
    from megatron.core.tensor_parallel import mappings

    orig_gather = mappings._gather_along_first_dim
    orig_rs = mappings._reduce_scatter_along_first_dim

    def _as_list(sizes):
        if sizes is None:
            return None
        if torch.is_tensor(sizes):
            return [int(s) for s in sizes.tolist()]
        return [int(s) for s in sizes]

    @functools.wraps(orig_gather)
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        sizes = _as_list(output_split_sizes)
        if sizes is None or group is None or group.size() == 1 or len(set(sizes)) == 1:
            return orig_gather(
                input_, group, output_split_sizes=output_split_sizes,
                use_global_buffer=use_global_buffer,
            )
        _hit("p7_uneven_gather")
        world = group.size()
        max_len = max(sizes)
        inp = input_.contiguous()
        if inp.shape[0] < max_len:
            pad = inp.new_zeros((max_len - inp.shape[0],) + tuple(inp.shape[1:]))
            inp = torch.cat([inp, pad], dim=0)
        gathered = torch.empty(
            (world * max_len,) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device
        )
        torch.distributed.all_gather_into_tensor(gathered, inp, group=group)
        chunks = gathered.split(max_len, dim=0)
        return torch.cat([chunks[r][: sizes[r]] for r in range(world)], dim=0)

    @functools.wraps(orig_rs)
    def _reduce_scatter_along_first_dim(
        input_, group, input_split_sizes=None, use_global_buffer=False
    ):
        sizes = _as_list(input_split_sizes)
        if sizes is None or group is None or group.size() == 1 or len(set(sizes)) == 1:
            return orig_rs(
                input_, group, input_split_sizes=input_split_sizes,
                use_global_buffer=use_global_buffer,
            )
        _hit("p7_uneven_reduce_scatter")
        rank = group.rank()
        buf = input_.contiguous().clone()
        torch.distributed.all_reduce(buf, group=group)
        start = sum(sizes[:rank])
        return buf[start : start + sizes[rank]].contiguous()

    _replace(mappings, "_gather_along_first_dim", _gather_along_first_dim)
    _replace(mappings, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim)


# --------------------------------------------------------------------------------------------------
# P8: Tensor.type() names CPU tensors as CUDA ones (the optimizer's dtype checks)
# --------------------------------------------------------------------------------------------------


def _patch_p8_tensor_type() -> None:
    """P8: Megatron's distributed optimizer (``distrib_optimizer.py`` ~466-481), its
    mixed-precision optimizer (``optimizer.py`` ~1033) and gradient clipping (``clip_grads.py``
    ~174) check dtypes with ``tensor.type()`` strings such as ``"torch.cuda.FloatTensor"`` and
    refuse CPU tensors. ``Tensor.type()`` called with no argument now reports the
    ``torch.cuda.*`` name of a CPU tensor; with an argument (a conversion) it is unchanged.
    See docs/notes/scale-trainer-deepspeed-te.md."""
    orig = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = orig(self)
            if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
                _hit("p8_tensor_type")
                return "torch.cuda." + name[len("torch."):]
            return name
        return orig(self, dtype, non_blocking, **kwargs)

    _replace(torch.Tensor, "type", type_, key="torch.Tensor.type")


# --------------------------------------------------------------------------------------------------
# P9: HybridDeviceOptimizer (optimizer CPU offload) takes the model's CPU parameters for device ones
# --------------------------------------------------------------------------------------------------


def _patch_p9_offload_split() -> None:
    """P9: megatron's ``HybridDeviceOptimizer._get_sub_optimizer_param_groups`` offloads the
    parameters whose ``is_cuda`` is true (a pinned host clone of each goes to the CPU optimizer,
    keyed by the device parameter) and counts everything already on the host as the host's own.
    On a CPU machine every parameter is on the host, so nothing would be offloaded and the step
    would look up host clones that were never made (KeyError). While that method runs, the
    parameters it was given report ``is_cuda`` true and everything else (the clones it makes)
    false: the offload path then runs as on a GPU, its "device" and host tensors distinct CPU
    tensors, the copies between them real copies."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    orig = HybridDeviceOptimizer._get_sub_optimizer_param_groups
    is_cuda = torch.Tensor.is_cuda

    @functools.wraps(orig)
    def _get_sub_optimizer_param_groups(self, offload_fraction):
        device = {id(p) for group in self.param_groups for p in group["params"]}
        torch.Tensor.is_cuda = property(lambda t: id(t) in device)
        try:
            _hit("p9_offload_split")
            return orig(self, offload_fraction)
        finally:
            torch.Tensor.is_cuda = is_cuda

    _replace(HybridDeviceOptimizer, "_get_sub_optimizer_param_groups", _get_sub_optimizer_param_groups)


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------


def apply_cpu_patches() -> None:
    """Apply all CPU patches (idempotent).  Returns immediately when CUDA is available."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    _patch_p2_cuda_runtime()
    _patch_p4_device_mode()
    _patch_p1_rng()
    _patch_p6_move_to_cpu()
    _patch_p7_uneven_collectives()
    _patch_p8_tensor_type()
    _patch_p9_offload_split()
    _APPLIED = True


def initialize_model_parallel_cpu(
    tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, seed: int = 1234
) -> None:
    """Patch, then ``parallel_state.initialize_model_parallel`` on the already-initialised gloo
    default process group, then ``torch.manual_seed(seed)`` + megatron's
    ``model_parallel_cuda_manual_seed(seed)`` (which, patched, seeds the CPU-backed tracker)."""
    apply_cpu_patches()
    from megatron.core import parallel_state, tensor_parallel

    if not torch.distributed.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel_cpu: call torch.distributed.init_process_group('gloo', ...) "
            "first"
        )
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        create_gloo_process_groups=False,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel_cpu() -> None:
    """Tear down megatron's parallel state (the default process group is left to the caller)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    try:
        from megatron.core.tensor_parallel import random as mrandom

        if mrandom._CUDA_RNG_STATE_TRACKER is not None:
            mrandom._CUDA_RNG_STATE_TRACKER.reset()
    except Exception:  # pragma: no cover  # noqa: BLE001 - best-effort cleanup
        pass
