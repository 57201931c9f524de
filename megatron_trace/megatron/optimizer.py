"""The trainer's optimizer: Megatron-core's own DistributedDataParallel and optimizer.

`TrainerOptimizer` wraps a TraceGPTModel in Megatron's `DistributedDataParallel` (gradients
accumulate in a contiguous FP32 buffer, `main_grad`; buckets are reduced over the data-parallel
group, expert buckets over the expert-data-parallel group, overlapped with backward when
`optim.overlap_grad_reduce`) and builds `get_megatron_optimizer`: AdamW on FP32 main parameters
of the BF16 model, sharded with the moments over the (expert-)data-parallel ranks when
`optim.distributed`, gradient clipping by global norm, optional CPU offload. Megatron's schedule
calls `finalize_model_grads` after the last micro-batch (DP reduction, sequence-parallel norm
gradients over TP, tied embeddings over PP).

Gradients are averaged over the data-parallel ranks (Megatron's default scaling, 1 / DP):
a loss that is a sum over this rank's tokens divided by (global tokens / DP) gives the
global token mean. `scale_grads` rescales the reduced gradients by a factor common to every
rank (e.g. global tokens / global kept tokens).

The optimizer state is saved as a Megatron distributed checkpoint (`save` / `load`,
"fully_reshardable" for the distributed optimizer), so it loads under any other data-parallel
size and TP/PP layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

import torch
from megatron.core import parallel_state as ps

from ..config import OptimSection

FRESH = "FRESH"
SCHEDULER = "lr_scheduler.json"  # Megatron OptimizerParamScheduler.state_dict()
_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _split_passthrough(extra: dict) -> tuple[dict, dict]:
    """optim.megatron's fields, split into (OptimizerConfig, DistributedDataParallelConfig)
    keyword arguments; ValueError naming a field neither has."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    opt_fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    ddp_fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    unknown = sorted(set(extra) - opt_fields - ddp_fields)
    if unknown:
        raise ValueError(f"config: optim.megatron: {unknown} are fields of neither megatron.core's OptimizerConfig "
                         "nor its DistributedDataParallelConfig")
    return ({k: v for k, v in extra.items() if k in opt_fields}, {k: v for k, v in extra.items() if k in ddp_fields})


class TrainerOptimizer:
    """Megatron DDP over `model` plus Megatron's optimizer; `model` stays the unwrapped module.

    `ddp` is what the forward-backward schedule runs (`megatron.schedule.run_microbatches`
    takes either); zero_grad / scale_grads / step as a training step calls them."""

    def __init__(self, model: torch.nn.Module, lr: float, optim: OptimSection | None = None):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        optim = optim or OptimSection()
        opt_extra, ddp_extra = _split_passthrough(optim.megatron)
        dp = ps.get_data_parallel_world_size()
        ddp_cfg = DistributedDataParallelConfig(**{
            "grad_reduce_in_fp32": True, "use_distributed_optimizer": optim.distributed,
            "overlap_grad_reduce": optim.overlap_grad_reduce and dp > 1, **ddp_extra})
        self.model, self.optim, self._opt_extra = model, optim, opt_extra
        self.ddp = DistributedDataParallel(model.config, ddp_cfg, model)
        # Megatron's schedule reduces the gradients after the last micro-batch's backward and
        # holds the bucket reductions back until then
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.no_sync_func = self.ddp.no_sync
        self.restart(lr)

    def restart(self, lr: float) -> None:
        """A fresh optimizer (FP32 main parameters from the model's, no moments) at learning rate
        `lr` over the same DDP buffers: a new phase of the run (SFT, then RL)."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        dtype = self.model.config.params_dtype  # (a stage's first parameter may be an FP32 norm)
        optim = self.optim
        self.config = OptimizerConfig(**{
            "optimizer": "adam", "lr": lr, "min_lr": lr, "weight_decay": optim.weight_decay,
            "bf16": dtype == torch.bfloat16, "params_dtype": dtype, "use_distributed_optimizer": optim.distributed,
            "clip_grad": optim.clip_grad,
            # offloaded: the FP32 masters, gradients and moments all on the host (precision-aware:
            # no FP32 master stays beside the BF16 model), as Megatron's docs pair them
            **({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0,
                "use_precision_aware_optimizer": True} if optim.cpu_offload else {}),
            **self._opt_extra})
        # offloaded, under no_grad: the distributed optimizer's shards of FP32 parameters (TRACE's
        # norms) are views, and the offloading optimizer takes only leaves
        with torch.no_grad() if optim.cpu_offload else contextlib.nullcontext():
            self.optimizer = get_megatron_optimizer(self.config, [self.ddp], use_gloo_process_groups=False)
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if hasattr(opt.optimizer, "sub_optimizers"):
                _load_offloaded_masters(opt.optimizer)
        self.scheduler = self._scheduler(lr)
        self.stepped = False  # a fresh optimizer's state is the model's weights: nothing to save

    def _scheduler(self, lr: float):
        """Megatron's OptimizerParamScheduler: linear warm-up from 0 over optim.lr_warmup_steps
        optimizer steps, then constant `lr`. A fresh Adam's first steps move every weight by about
        the learning rate whatever its gradient (bias correction makes them sign steps), which
        undoes a warmed-up model at RL learning rates; the warm-up lets the moments settle."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        warmup, wd = self.optim.lr_warmup_steps, self.optim.weight_decay
        return OptimizerParamScheduler(self.optimizer, init_lr=0.0, max_lr=lr, min_lr=lr, lr_warmup_steps=warmup,
                                       lr_decay_steps=warmup + 1, lr_decay_style="constant", start_wd=wd, end_wd=wd,
                                       wd_incr_steps=1, wd_incr_style="constant")

    def zero_grad(self) -> None:
        """Empty the gradient buffers (the start of a step)."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def scale_grads(self, factor: float) -> None:
        """Multiply the (reduced) gradients by `factor`, the same on every rank."""
        self.ddp.scale_gradients(factor)

    def step(self) -> dict:
        """Clip and step; the model's BF16 parameters hold the new weights on every rank.
        Returns {"grad_norm": the global L2 norm before clipping, "lr": the step's learning rate}."""
        self.scheduler.step(1)  # the n-th step runs at lr * min(1, n / warm-up steps)
        lr = self.optimizer.param_groups[0]["lr"]
        ok, grad_norm, _ = self.optimizer.step()
        self.stepped = True
        if not ok:  # BF16 has no loss scaler, so a step is never skipped for overflow
            raise RuntimeError("Megatron's optimizer skipped the step")
        return {"grad_norm": float(grad_norm) if grad_norm is not None else 0.0, "lr": float(lr)}

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (FP32 main parameters and AdamW moments; on
        the host under optim.cpu_offload), measured from the live tensors."""
        seen, total = set(), 0
        for inner in _torch_optimizers(self.optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    tensors = [p, *[v for v in inner.state.get(p, {}).values() if torch.is_tensor(v) and v.dim()]]
                    for t in tensors:
                        if t.data_ptr() not in seen:
                            seen.add(t.data_ptr())
                            total += t.numel() * t.element_size()
        return total

    # -- checkpoints ---------------------------------------------------------------------------
    def _sub_optimizers(self) -> int:
        return len(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _zero_adam_state(self) -> None:
        """AdamW state of step 0 for every parameter that has none yet: Megatron's loading
        builds its state dict from the live state, and with torch's AdamW (no Apex / TE on the
        CPU) it reads each parameter's "step", which Megatron's own init_state_fn leaves unset."""
        for opt in _torch_optimizers(self.optimizer):
            if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
                continue
            for group in opt.param_groups:
                for p in group["params"]:
                    if not opt.state[p]:
                        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                        "exp_avg_sq": torch.zeros_like(p)}
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if hasattr(opt.optimizer, "sub_optimizers"):  # offloaded: the state Megatron reads is its mirror
                opt.optimizer._sync_sub_optimizers_state_to_hdo()

    def _sharded(self, is_loading: bool) -> dict:
        return self.optimizer.sharded_state_dict(self.model.sharded_state_dict(), is_loading=is_loading,
                                                 metadata=_SHARDING)

    def save(self, directory: str | os.PathLike) -> None:
        """Save the optimizer state as a Megatron distributed checkpoint at `directory` (a new
        directory; an optimizer that has not stepped writes only the file FRESH); call on every rank."""
        from megatron.core import dist_checkpointing

        from ..checkpoint.dist import results_queue_in_process

        directory = Path(directory)
        if not self.stepped:
            if torch.distributed.get_rank() == 0:
                directory.mkdir(parents=True)
                (directory / FRESH).write_text("no step taken: the state is the model's weights\n")
            return
        results_queue_in_process()
        if torch.distributed.get_rank() == 0:
            directory.mkdir(parents=True)
        torch.distributed.barrier()
        dist_checkpointing.save({"optimizer": self._sharded(False)}, str(directory))
        if torch.distributed.get_rank() == 0:  # inside the run checkpoint's temporary directory
            (directory / SCHEDULER).write_text(json.dumps(self.scheduler.state_dict()))

    def load(self, directory: str | os.PathLike) -> None:
        """Load what `save` wrote, under any data-parallel size and TP/PP layout; call on every rank."""
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        if (directory / FRESH).exists():
            return
        if not (directory / "metadata.json").exists():
            raise FileNotFoundError(f"no optimizer checkpoint at {directory}")
        self._zero_adam_state()
        state = dist_checkpointing.load({"optimizer": self._sharded(True)}, str(directory))
        state = _regroup(state["optimizer"], self._sub_optimizers())
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            _copy_states_without_step(opt)
        self.optimizer.load_state_dict(state)
        if (directory / SCHEDULER).exists():
            self.scheduler.num_steps = json.loads((directory / SCHEDULER).read_text())["num_steps"]
            self.scheduler.step(0)
        # megatron-core 0.19.2 (torch's AdamW path) gives every parameter the same "step"
        # tensor, which torch's step then advances once per parameter: one tensor each
        for opt in _torch_optimizers(self.optimizer):
            for st in opt.state.values():
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].clone()
        self.stepped = True


def _regroup(loaded: dict, current: int) -> dict:
    """A loaded optimizer state in this run's grouping into Megatron sub-optimizers.

    Megatron keeps one optimizer for the dense parameters and, when their data-parallel groups
    differ (expert parallelism, or expert TP unlike TP), one for the experts; the common state
    (param groups, step) is stored per sub-optimizer, the tensors in model space. Loading
    into another grouping gets the checkpoint's common state beside this run's tensors: each
    sub-optimizer is given every saved param group (Megatron picks its own by their
    identifying keys; the steps are synchronized before saving) and its own tensors."""
    flat = "optimizer" in loaded  # saved by one optimizer
    saved = [loaded] if flat else [loaded[k] for k in sorted(k for k in loaded if isinstance(k, int))]
    if len(saved) == current:
        return loaded
    groups = [g for sub in saved for g in sub["optimizer"]["param_groups"]]
    # a group's is_expert_parallel says whether it sat in an experts' own optimizer: a copy of
    # each group with the flag flipped stands in where the other grouping has no such group
    # (Megatron's lookup keeps the last of equal identifiers: the saved ones come last)
    flipped = [{**g, "is_expert_parallel": not g.get("is_expert_parallel", False)} for g in groups]
    common = {"optimizer": {"param_groups": flipped + groups},
              "param_state_sharding_type": saved[0]["param_state_sharding_type"]}
    if current == 1:
        return common | {"param_state": loaded["param_state"]}
    return {i: common | {"param_state": loaded[i]["param_state"]} for i in range(current)}


def _copy_states_without_step(opt) -> None:
    """megatron-core 0.19.2 with torch's AdamW (no Apex / TE): loading a "fully_reshardable"
    state copies every tensor of a parameter's live AdamW state from the checkpoint's, "step"
    included, which the checkpoint keeps per param group instead (KeyError: 'step'); offloaded,
    the live state also holds "master_param", the tensor the host optimizer steps, which the
    checkpoint keeps as "param". This instance's copy leaves out what the checkpoint does not
    hold; Megatron sets the step from the param groups itself, `_load_offloaded_masters` the
    master."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(opt, DistributedOptimizer) or not isinstance(opt.optimizer, torch.optim.Optimizer):
        return
    copy = opt._set_main_param_and_optimizer_states

    def without_unsaved(model_param, tensors):
        group, order = opt.model_param_group_index_map[model_param]
        state = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
        unsaved = {k: state.pop(k) for k in ("step", "master_param") if k in state and k not in tensors}
        try:
            copy(model_param, tensors)
        finally:
            for k, v in unsaved.items():  # (precision-aware, the copy sets "master_param" itself)
                state.setdefault(k, v)

    opt._set_main_param_and_optimizer_states = without_unsaved


def _load_offloaded_masters(hdo) -> None:
    """megatron-core 0.19.2's offloading optimizer (HybridDeviceOptimizer) after loading a state:
    its own update of the tensors its sub-optimizers step (`_update_fp32_params_by_new_state`)
    covers only the FP32 copies it made of BF16 parameters, raises KeyError on any other (the
    distributed optimizer's FP32 main shards, TRACE's FP32 norms), and leaves the host copies
    of offloaded parameters at their values from before the load, so the next step would start
    from those. This instance's update writes each loaded master value (the parameter itself
    when it is FP32, else the state's "master_param") into the tensor that is stepped, and
    keeps "master_param" that tensor, as a step leaves it."""

    @torch.no_grad()  # (the FP32 shards are views made under no_grad, see TrainerOptimizer.restart)
    def update_stepped_params_from_state():
        for param, state in hdo.state.items():
            inner = hdo.param_to_inner_param.get(param, param)
            if inner is param:
                continue
            master = param if param.dtype == torch.float32 else state.get("master_param")
            if master is not None and master is not inner:
                inner.data.copy_(master)
            if hdo.param_update_in_fp32:
                state["master_param"] = inner

    hdo._update_fp32_params_by_new_state = update_stepped_params_from_state


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside Megatron's (chained, offloaded) one."""
    found = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        found += getattr(inner, "sub_optimizers", [inner])
    return found


def has_optimizer_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether `save` wrote to `directory`."""
    return (Path(directory) / FRESH).exists() or (Path(directory) / "metadata.json").exists()
