"""Packed micro-batches through Megatron's forward-backward schedule, under any layout.

`run_microbatches` is the trainer step's single entry to the model: without pipeline
parallelism the schedule is a plain forward (and backward) per micro-batch, gradients
accumulating; with it, activations and gradients travel between stages (1F1B) and the loss
exists on the last stage only. The loss is given as a function of
the per-token log-probabilities, and what it reports is broadcast to every stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import unwrap_model

from .context import MicroBatchGuidance, checks_read_at_end

LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict]]


def infos_to_host(infos: list[dict | None]) -> list[dict | None]:
    """The loss functions' infos with their tensor values on the host, at one synchronisation per
    device: 0-d tensors become Python floats, others CPU tensors; other values stay.
    A loss function that returns its statistics as device tensors then leaves the micro-batches'
    forwards and backwards free of host synchronisations (a `float(t)` in the loss made the host
    wait for each forward before it could launch the backward)."""
    scalars: dict[torch.device, list[tuple[dict, str]]] = {}
    for info in infos:
        for key, value in (info or {}).items():
            if torch.is_tensor(value):
                if value.dim() == 0:
                    scalars.setdefault(value.device, []).append((info, key))
                else:
                    info[key] = value.detach().cpu()
    for device_scalars in scalars.values():
        values = torch.stack([info[key].detach().double() for info, key in device_scalars]).tolist()
        for (info, key), value in zip(device_scalars, values, strict=True):
            info[key] = value
    return infos


@dataclass
class MicroBatch:
    """One packed THD micro-batch: input_ids, position_ids, targets int64 [1, T], its
    PackedSeqParams, and its guidance (whole model; each stage takes its layers) or None."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    packed_seq_params: object
    guidance: MicroBatchGuidance | None = None


def run_microbatches(model, batches: list[MicroBatch],
                     loss_fn: Callable[[int, torch.Tensor], tuple[torch.Tensor, dict]], *,
                     forward_only: bool = False) -> list[dict]:
    """Forward (and, unless forward_only, backward) of each micro-batch, through Megatron's
    schedule (1F1B across pipeline stages).

    Args:
        model: a TraceGPTModel, or to train, the `ddp` of its `optimizer.TrainerOptimizer`
            (gradients accumulate in its buffers and are reduced after the last micro-batch).
        loss_fn(i, logp): on the last stage, for micro-batch i with logp float32 [T_i] =
            log p(targets[t] | ids[:t+1]); returns (scalar loss to backpropagate as is, info
            dict of plain values or tensors: `infos_to_host`). Megatron divides each loss by the
            number of micro-batches; this undoes it, so gradients are those of the sum of the
            returned losses.
    Returns:
        each micro-batch's info, on every rank of the pipeline.
    """
    inner = unwrap_model(model)  # a TraceGPTModel, or Megatron's DDP over one (training)
    lengths = {b.input_ids.shape[1] for b in batches}
    if len(lengths) > 1 and ps.get_pipeline_model_parallel_world_size() > 1 and not inner.config.variable_seq_lengths:
        raise ValueError("micro-batches of differing lengths across pipeline stages need the alltoall token dispatcher")
    offset = get_transformer_layer_offset(inner.config)
    layers = range(offset, offset + len(inner.decoder.layers))
    infos = {}
    n = len(batches)

    def forward_step(data_iter, m):
        i = next(data_iter)
        mb = batches[i]
        # guidance waits in host memory; only micro-batches in flight hold theirs on the device
        stage = None if mb.guidance is None else mb.guidance.for_layers(layers).to(mb.input_ids.device)
        out = m(mb.input_ids, mb.position_ids, None, labels=mb.targets, packed_seq_params=mb.packed_seq_params,
                guidance=stage)

        def loss_func(loss_per_token):
            loss, info = loss_fn(i, -loss_per_token.float().reshape(-1))
            infos[i] = info
            return loss * n, {}
        return out, loss_func

    with checks_read_at_end():  # one wait for the GPU, not one between each forward and its backward
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(range(n)), model=[model],
                                    num_microbatches=n, seq_length=max(b.input_ids.shape[1] for b in batches),
                                    micro_batch_size=1, forward_only=forward_only)
    box = [infos_to_host([infos.get(i) for i in range(n)]) if infos else None]
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
    return box[0]


def run_microbatch(model, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor,
                   packed_seq_params, loss_fn: LossFn, *, guidance: MicroBatchGuidance | None = None,
                   forward_only: bool = False) -> dict:
    """`run_microbatches` of one micro-batch: loss_fn(logp) -> (loss, info); returns the info."""
    batch = MicroBatch(input_ids, position_ids, targets, packed_seq_params, guidance)
    return run_microbatches(model, [batch], lambda i, logp: loss_fn(logp), forward_only=forward_only)[0]
