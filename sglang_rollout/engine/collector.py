"""What one `generate` call returns, assembled as steps finish: each sample's result, the
guidance records of its captured rows and its routed experts (prompt records once per group),
and the streaming of finished groups to an `on_group` callback."""

from __future__ import annotations

import torch

from megatron_trace.guidance import (
    GroupGuidance,
    GuidanceBatch,
    SampleGuidance,
    capture_dense,
    capture_sparse_sites,
)
from megatron_trace.model_config import ModelConfig
from megatron_trace.rollout import GroupRequest, RolloutOutput, SampleResult

from .config import EngineConfig
from .row_store import RowStore
from .sequence import Sequence


class RolloutCollector:
    """Results and guidance of one `generate` call over `requests` (see the module docstring)."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, weight_version: int,
                 requests: list[GroupRequest], on_group, max_new_tokens: int):
        self.model_cfg, self.engine_cfg, self.weight_version = model_cfg, engine_cfg, weight_version
        self.order = [f"{r.group_id}/{i}" for r in requests for i in range(r.n)]
        self.group_sizes = {r.group_id: r.n for r in requests}
        self.results: dict[str, SampleResult] = {}
        self.guidance = GuidanceBatch()
        self.on_group, self.streamed = on_group, set()
        # captured rows and routed experts ("experts": [tokens, layers, top_k]) of the running sequences
        slot = max((len(r.prompt_ids) for r in requests), default=1) + max_new_tokens
        self.rows = RowStore(slot, lambda key: 1 if key == "experts" else model_cfg.rows_per_token(*key),
                             slots=min(64, sum(r.n + 1 for r in requests)))

    def sample_ids(self, req: GroupRequest) -> list[str]:
        """The ids of a request's samples, "<group id>/<index>"."""
        return [f"{req.group_id}/{i}" for i in range(req.n)]

    def fail(self, req: GroupRequest, error: str) -> None:
        """Every sample of a request that cannot run: finish_reason "error", `error` saying why."""
        for sid in self.sample_ids(req):
            self.results[sid] = SampleResult(sample_id=sid, group_id=req.group_id, prompt_len=len(req.prompt_ids),
                                             tokens=[], logprobs=torch.zeros(0), finish_reason="error",
                                             weight_version=self.weight_version, error=error)

    def add_rows(self, captured: dict, routed: torch.Tensor, segments: list[tuple[Sequence, int]]) -> None:
        """One forward's captured host rows ({(layer, site): rows}) and routed experts
        [tokens, layers, top_k] of `segments` ((sequence, new tokens), in order)."""
        self.rows.write({**captured, "experts": routed}, segments)

    def drop_rows(self, seq: Sequence) -> None:
        """Forget a sequence's rows (a prompt whose guidance another job records)."""
        self.rows.drop(seq)

    def record_prompt(self, prompt: Sequence) -> None:
        """A group's prompt guidance and routed experts, once its prefill is taken in."""
        rows = self.rows.take(prompt)
        self.guidance.add_group(GroupGuidance(group_id=prompt.group_id, prompt_len=prompt.prompt_len,
                                              records=self._records(rows, prompt.group_id),
                                              routed_experts=self._experts(rows)))

    def finish(self, seq: Sequence) -> None:
        """A finished sample's result and guidance; its group is streamed once complete."""
        self.results[seq.seq_id] = SampleResult(sample_id=seq.seq_id, group_id=seq.group_id, prompt_len=seq.prompt_len,
                                                tokens=seq.response,
                                                logprobs=torch.tensor(seq.logprobs, dtype=torch.float32),
                                                finish_reason=seq.finish_reason, weight_version=self.weight_version)
        rows = self.rows.take(seq)
        self.guidance.add_sample(SampleGuidance(sample_id=seq.seq_id, group_id=seq.group_id,
                                                response_len=seq.num_response, weight_version=self.weight_version,
                                                records=self._records(rows, seq.seq_id),
                                                routed_experts=self._experts(rows)))
        self.stream(seq.group_id)

    def stream(self, group_id: str) -> None:
        """Hand a finished group to `on_group`, once."""
        if self.on_group is None or group_id in self.streamed:
            return
        ids = [f"{group_id}/{i}" for i in range(self.group_sizes[group_id])]
        if not all(sid in self.results for sid in ids):
            return
        self.streamed.add(group_id)
        self.on_group(RolloutOutput([self.results[sid] for sid in ids], self.guidance.subset(ids)))

    def output(self) -> RolloutOutput:
        """Every sample in request order, with the guidance; groups refused at admission are streamed last."""
        for group_id in self.group_sizes:
            self.stream(group_id)
        return RolloutOutput([self.results[sid] for sid in self.order], self.guidance)

    def _experts(self, rows: dict) -> dict[int, torch.Tensor]:
        routed = rows["experts"]  # [tokens, MoE layers, top_k]
        return {layer: routed[:, i].contiguous() for i, layer in enumerate(self.model_cfg.moe_layers)}

    def _records(self, rows: dict, owner: str) -> dict:
        cfg = self.engine_cfg
        header = dict(model_id=cfg.model_id, sample_id=owner, weight_version=self.weight_version, policy=cfg.guide)
        kept = {key: parts for key, parts in rows.items() if key != "experts"}
        if cfg.coding == "dense":  # (bits, scales, g) of the fused quantize kernel
            return {(layer, site): capture_dense(*parts, layer=layer, site=site, **header)
                    for (layer, site), parts in kept.items()}
        # guidance.sparse_parts, computed by the engine for the whole step; the owner's sites at once
        return capture_sparse_sites(kept, **header, tau=cfg.tau, scale_coding=cfg.scale_coding)
