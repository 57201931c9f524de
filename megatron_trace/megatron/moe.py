"""Megatron's MoE layer with rollout routing replay, per-token fc1 quantization and expert
guidance that follows its tokens.

Routing replay: when the active micro-batch carries the engine's expert ids for this layer,
the router's native `RouterReplay` is set to replay them (REPLAY_FORWARD, also during
recomputation); the gate weights are recomputed from the trainer's own router scores at
those experts.

fc1: a token's fc1 input is the same row for each of its k experts, so it is quantized once,
per token, before dispatch (`fc1_input`; its guidance rows are the token rows), as engines
quantize activations before their fused MoE GEMM. The experts' fc1 sites quantize weights only.

fc2: its rows are (token, expert) pairs, wherever the dispatcher sends them (other
expert-parallel ranks included). So each token's fc2 guidance travels with it: before
dispatch every local token gets a byte row (the fc2 guidance of its top-k slots and its
expert ids) and a second dispatcher of the same kind moves those bytes exactly as the first
moves the hidden states. After dispatch each row keeps the slot of the expert it was sent to.
Where the dispatch group is this rank alone and nothing is dropped or padded, the dispatcher
only sorts the (token, slot) rows by expert, so the fc2 rows are taken in that order directly:
no second dispatch, no byte rows, no host synchronisation.

Checks that would otherwise wait for the GPU once a layer are deferred (`defer_check`): routed
ids in range and not repeated within a token (`MicroBatchGuidance.check_routed_experts`; the
layers index with the ids clamped into range meanwhile), and that the tokens' experts are those
the engine routed. They are read once after all of a call's micro-batches (`checks_read_at_end`),
or at the forward's end outside such a call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)

from ..guidance.codec import GuidanceFormatError
from ..guidance.rows import RowGuidance
from ..modes import TrainerPrecision
from . import context, qat
from .context import expert_major_order
from .qat import FP4Site, Shard

_KIND_BITS = 4  # RowGuidance.kind flags


def _kind_code(rg: RowGuidance | None) -> int:
    return 0 if rg is None else 1 + sum(int(b) << i for i, b in enumerate(rg.kind))


def _kind(code: int) -> tuple[bool, bool, bool]:
    return tuple(bool((code - 1) >> i & 1) for i in range(_KIND_BITS))


class TraceMoELayer(MoELayer):
    """MoELayer (token dispatcher "alltoall" or "allgather") with routing replay and guided
    expert sites. `precision`, `tokens` (the sequence-parallel token shard) and `fc1_input`
    (the fc1 input site) are set by `attach_sites`."""

    precision: TrainerPrecision = TrainerPrecision.BF16
    tokens: Shard | None = None
    fc1_input: FP4Site | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.token_dispatcher, (MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher)):
            raise NotImplementedError(f"TRACE supports the allgather and alltoall token dispatchers, "
                                      f"not {type(self.token_dispatcher).__name__}")
        td = self.token_dispatcher
        # A twin dispatcher: same routing, same communication, carrying guidance bytes.
        twin = object.__new__(type(td))
        twin.__dict__.update(td.__dict__)
        self.guidance_dispatcher = twin
        self._payload = None

    @property
    def layer(self) -> int:
        return self.layer_number - 1

    def _local_token_rows(self, num_tokens: int) -> slice:
        if self.tokens is None or self.tokens.size == 1:
            return slice(0, num_tokens)
        return slice(*self.tokens.span(num_tokens))

    # -- routing replay ---------------------------------------------------------------------
    def route(self, hidden_states, padding_mask=None):
        mb = context.active()
        ids = None if mb is None else mb.routed_ids(self.layer)
        replay = self.router.router_replay
        if ids is not None:
            if replay is None:
                raise GuidanceFormatError("routing replay needs TransformerConfig.moe_enable_routing_replay=True")
            local = ids[self._local_token_rows(mb.num_tokens)]
            if local.shape != (hidden_states.shape[0] * hidden_states.shape[1], self.config.moe_router_topk):
                raise GuidanceFormatError(f"layer {self.layer}: routed experts {tuple(local.shape)} for "
                                          f"{tuple(hidden_states.shape[:2])} tokens and "
                                          f"top-{self.config.moe_router_topk}")
            replay.target_topk_idx = local.to(hidden_states.device)
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        elif replay is not None and replay.router_replay_action is RouterReplayAction.REPLAY_FORWARD:
            replay.clear_router_replay_action()  # ours from an earlier micro-batch; RECORD stays
        return super().route(hidden_states, padding_mask)

    # -- fc2 guidance riding with the tokens -------------------------------------------------
    def _fc2_guidance(self) -> tuple[RowGuidance | None, torch.Tensor | None, int]:
        """(this micro-batch's fc2 guidance, the engine's routed experts of this rank's tokens
        int64 [local tokens, top_k], fc2 kind code), or (None, None, 0) when fc2 takes no rows."""
        mb = context.active()
        # guided fc2 needs its rows; so do observers (flip counts) of an FP4 forward
        if self.precision is not TrainerPrecision.FP4_GUIDED and not (qat.observers and self.precision.quantizes):
            return None, None, 0
        fc2 = None if mb is None else mb.site(self.layer, "fc2")
        code = torch.tensor([_kind_code(fc2)], dtype=torch.int64)
        # Every rank of the dispatch group must agree, or the twin's collectives would hang.
        group = self.token_dispatcher.tp_ep_group
        if dist.get_world_size(group) > 1:
            dev = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                   else torch.device("cpu"))
            lo, hi = code.to(dev), code.to(dev)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
            if not torch.equal(lo, hi):
                raise GuidanceFormatError(f"layer {self.layer}: ranks of the expert dispatch group disagree about "
                                          "whether fc2 carries guidance (or its coding)")
        if fc2 is None:
            return None, None, 0
        ids = mb.routed_ids(self.layer)
        if ids is None:
            raise GuidanceFormatError(f"layer {self.layer}: guided fc2 needs the engine's routed experts "
                                      "(rollout routing replay)")
        rows = self._local_token_rows(mb.num_tokens)
        fc2 = fc2.select_rows(self._slot_rows(rows, fc2.g.device))
        return fc2, ids[rows], int(code)

    def _slot_rows(self, tokens: slice, device) -> torch.Tensor:
        """fc2 rows ((token, slot) order) of the tokens in `tokens`: int64 [len * top_k]."""
        top_k = self.config.moe_router_topk
        token_rows = torch.arange(tokens.start, tokens.stop, device=device)
        return (token_rows[:, None] * top_k + torch.arange(top_k, device=device)).reshape(-1)

    def _dispatch_is_a_sort(self) -> bool:
        """True when the dispatcher only sorts this rank's (token, slot) rows by expert: its
        group is this rank alone, and it neither drops nor pads."""
        return (dist.get_world_size(self.token_dispatcher.tp_ep_group) == 1
                and self.config.moe_expert_capacity_factor is None
                and not self.config.moe_router_padding_for_quantization)

    def preprocess(self, hidden_states, probs, routing_map):
        num_local = hidden_states.shape[0] * hidden_states.shape[1]
        fc2, ids, code = self._fc2_guidance()
        if self.fc1_input is not None:  # after routing: the router sees the high-precision input
            hidden_states = self.fc1_input.quantize_input(hidden_states)
        out = super().preprocess(hidden_states, probs, routing_map)
        self._payload = self._sorted = None
        if fc2 is None:
            return out
        if self._dispatch_is_a_sort():
            self._sorted = self._sorted_fc2_rows(fc2, ids, routing_map)
        else:
            ids_bytes = ids.to(torch.int32).contiguous().view(torch.uint8).reshape(num_local, -1)
            payload = torch.cat([fc2.to_row_bytes().reshape(num_local, -1), ids_bytes.to(fc2.g.device)], dim=1)
            payload = payload.to(hidden_states.device)
            pre = self.guidance_dispatcher.dispatch_preprocess(payload.view(*hidden_states.shape[:2], -1),
                                                               routing_map, probs.detach())
            self._payload = (pre, code)
        return out

    def _sorted_fc2_rows(self, fc2: RowGuidance, ids: torch.Tensor, routing_map: torch.Tensor):
        """(fc2 rows in dispatch order, rows per expert int64 [E]) when the dispatch is a sort of
        this rank's rows; that the router chose the engine's experts is checked at the forward's end."""
        ids = ids.to(routing_map.device, torch.int64)
        engine_map = torch.zeros_like(routing_map).scatter_(1, ids, True)
        context.active().defer_check(self.layer, "the router's experts are not the engine's (guided fc2 needs "
                                     "rollout routing replay)", (engine_map == routing_map).all())
        return fc2.select_rows(expert_major_order(ids).to(fc2.g.device)), engine_map.sum(0)

    def dispatch(self, hidden_states, probs):
        out = super().dispatch(hidden_states, probs)
        if self._payload is not None:
            (payload, payload_probs), codes = self._payload
            self._payload = (self.guidance_dispatcher.token_dispatch(payload, payload_probs), codes)
        return out

    def routed_experts_compute(self, hidden_states, probs):
        mb = context.active()
        if self._sorted is not None:
            mb.expert_rows[self.layer], self._sorted = self._sorted, None
        elif self._payload is not None:
            (payload, payload_probs), code = self._payload
            self._payload = None
            rows, counts, _ = self.guidance_dispatcher.dispatch_postprocess(payload, payload_probs)
            mb.expert_rows[self.layer] = (self._fc2_rows(rows, counts, code), counts)
        elif mb is not None:
            mb.expert_rows.pop(self.layer, None)
        return super().routed_experts_compute(hidden_states, probs)

    def _fc2_rows(self, rows: torch.Tensor, counts: torch.Tensor, code: int) -> RowGuidance:
        """fc2 guidance of the dispatched rows (`counts` int64 [local experts] of them, per
        expert): each row's slot is the one of its expert."""
        top_k, cfg = self.config.moe_router_topk, self.config
        n2 = RowGuidance.row_nbytes(cfg.moe_ffn_hidden_size, _kind(code))
        per_slot = rows[:, : top_k * n2].reshape(-1, top_k, n2)
        ids = rows[:, top_k * n2:].contiguous().view(torch.int32).long()
        local = torch.tensor(self.local_expert_indices, device=rows.device)
        expert = torch.repeat_interleave(local, counts.to(rows.device), output_size=rows.shape[0])
        hit = ids == expert[:, None]
        context.active().defer_check(self.layer, "a token reached an expert the engine did not route it to "
                                     "(guided fc2 needs rollout routing replay)", hit.any(1).all())
        slot = hit.int().argmax(1)
        return RowGuidance.from_row_bytes(per_slot[torch.arange(len(slot), device=rows.device), slot].contiguous(),
                                          cfg.moe_ffn_hidden_size, _kind(code))
