"""One packed micro-batch through Megatron's forward-backward schedule, under any layout.

`run_microbatch` is the trainer step's single entry to the model: without pipeline parallelism
the schedule is a plain forward (and backward); with it, activations and gradients travel
between stages and the loss exists on the last stage only. The loss is given as a function of
the per-token log-probabilities, and what it reports is broadcast to every stage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from .context import MicroBatchGuidance

LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict]]


def run_microbatch(model, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor,
                   packed_seq_params, loss_fn: LossFn, *, guidance: MicroBatchGuidance | None = None,
                   forward_only: bool = False) -> dict:
    """Forward (and, unless forward_only, backward into .grad) of one THD micro-batch.

    Args:
        input_ids, position_ids, targets: int64 [1, T]; packed_seq_params: its THD layout.
        loss_fn(logp): on the last stage, with logp float32 [T] = log p(targets[t] | ids[:t+1]);
            returns (scalar loss to backpropagate, info dict of plain values).
        guidance: the micro-batch's guidance (whole model; each stage takes its layers).
    Returns:
        loss_fn's info, on every rank of the pipeline.
    """
    offset = get_transformer_layer_offset(model.config)
    stage = None if guidance is None else guidance.for_layers(range(offset, offset + len(model.decoder.layers)))
    infos = []

    def forward_step(data_iter, m):
        next(data_iter)
        out = m(input_ids, position_ids, None, labels=targets, packed_seq_params=packed_seq_params, guidance=stage)

        def loss_func(loss_per_token):
            loss, info = loss_fn(-loss_per_token.float().reshape(-1))
            infos.append(info)
            return loss, {}
        return out, loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([0]), model=[model],
                                num_microbatches=1, seq_length=input_ids.shape[1], micro_batch_size=1,
                                forward_only=forward_only)
    box = [infos[0] if infos else None]
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
    return box[0]
