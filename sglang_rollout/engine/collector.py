"""What one `generate` call returns, assembled as steps finish: each sample's result, the
guidance records of its captured rows and its routed experts (prompt records once per group),
and the streaming of finished groups to an `on_group` callback."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import torch

from megatron_trace.guidance import GroupGuidance, GuidanceBatch, SampleGuidance, capture, capture_dense
from megatron_trace.model_config import ModelConfig
from megatron_trace.rollout import GroupRequest, RolloutOutput, SampleResult
from trace_kernels.fp4 import quantize

from .config import EngineConfig
from .model import rows_per_token
from .sequence import Rows, Sequence


def _host_array(t: torch.Tensor) -> np.ndarray:
    """numpy view of a host tensor (BF16 through its int16 bits: numpy has no bfloat16)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _host_tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.view(dtype) if dtype == torch.bfloat16 else t


class RolloutCollector:
    """Results and guidance of one `generate` call over `requests` (see the module docstring)."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, weight_version: int,
                 requests: list[GroupRequest], on_group=None):
        self.model_cfg, self.engine_cfg, self.weight_version = model_cfg, engine_cfg, weight_version
        self.order = [f"{r.group_id}/{i}" for r in requests for i in range(r.n)]
        self.group_sizes = {r.group_id: r.n for r in requests}
        self.results: dict[str, SampleResult] = {}
        self.guidance = GuidanceBatch()
        self.on_group, self.streamed = on_group, set()
        self._row_dtypes: dict[tuple[int, str], tuple[torch.dtype, ...]] = {}  # of each (layer, site)'s parts

    def sample_ids(self, req: GroupRequest) -> list[str]:
        """The ids of a request's samples, "<group id>/<index>"."""
        return [f"{req.group_id}/{i}" for i in range(req.n)]

    def fail(self, req: GroupRequest, error: str) -> None:
        """Every sample of a request that cannot run: finish_reason "error", `error` saying why."""
        for sid in self.sample_ids(req):
            self.results[sid] = SampleResult(sample_id=sid, group_id=req.group_id, prompt_len=len(req.prompt_ids),
                                             tokens=[], logprobs=torch.zeros(0), finish_reason="error",
                                             weight_version=self.weight_version, error=error)

    def split_rows(self, captured: dict, sizes: list[int]) -> dict[tuple[int, str], list[Rows]]:
        """{(layer, site): one piece per segment} of a step's captured host rows (segments of
        `sizes` tokens, in order), as numpy views: a numpy slice costs a tenth of a torch view,
        and slicing every sequence, layer and site as torch views cost 50 ms a step at 8 guided
        layers and batch 64 (host time)."""
        pieces = {}
        bounds = [0]
        for m in sizes:
            bounds.append(bounds[-1] + m)
        for (layer, site), rows in captured.items():
            per = rows_per_token(self.model_cfg, site)
            parts = rows if isinstance(rows, tuple) else (rows,)
            self._row_dtypes[(layer, site)] = tuple(t.dtype for t in parts)
            arrays = [_host_array(t) for t in parts]
            cut = [(a * per, b * per) for a, b in pairwise(bounds)]
            if isinstance(rows, tuple):
                pieces[(layer, site)] = [tuple(x[a:b] for x in arrays) for a, b in cut]
            else:
                pieces[(layer, site)] = [arrays[0][a:b] for a, b in cut]
        return pieces

    def record_prompt(self, prompt: Sequence) -> None:
        """A group's prompt guidance and routed experts, once its prefill is taken in."""
        self.guidance.add_group(GroupGuidance(group_id=prompt.group_id, prompt_len=prompt.prompt_len,
                                              records=self._records(prompt, prompt.group_id),
                                              routed_experts=self._experts(prompt)))

    def finish(self, seq: Sequence) -> None:
        """A finished sample's result and guidance; its group is streamed once complete."""
        self.results[seq.seq_id] = SampleResult(sample_id=seq.seq_id, group_id=seq.group_id, prompt_len=seq.prompt_len,
                                                tokens=seq.response,
                                                logprobs=torch.tensor(seq.logprobs, dtype=torch.float32),
                                                finish_reason=seq.finish_reason, weight_version=self.weight_version)
        self.guidance.add_sample(SampleGuidance(sample_id=seq.seq_id, group_id=seq.group_id,
                                                response_len=len(seq.response), weight_version=self.weight_version,
                                                records=self._records(seq, seq.seq_id),
                                                routed_experts=self._experts(seq)))
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

    def _join_rows(self, key: tuple[int, str], pieces: list[Rows]):
        """A sequence's pieces of one (layer, site), concatenated in token order as torch tensors."""
        dtypes = self._row_dtypes[key]
        if isinstance(pieces[0], tuple):
            return tuple(_host_tensor(np.concatenate(parts), d)
                         for parts, d in zip(zip(*pieces, strict=True), dtypes, strict=True))
        return _host_tensor(np.concatenate(pieces), dtypes[0])

    def _experts(self, seq: Sequence) -> dict[int, torch.Tensor]:
        routed = torch.cat(seq.experts)  # [tokens, layers, top_k]
        return {layer: routed[:, layer].contiguous() for layer in range(self.model_cfg.num_layers)}

    def _records(self, seq: Sequence, owner: str) -> dict:
        cfg, records = self.engine_cfg, {}
        for layer, site in seq.rows[0] if seq.rows else ():
            kept = self._join_rows((layer, site), [step[(layer, site)] for step in seq.rows])
            header = dict(model_id=cfg.model_id, layer=layer, site=site, sample_id=owner,
                          weight_version=self.weight_version, policy=cfg.guide)
            if isinstance(kept, tuple):  # (bits, scales, g) from the fused quantize kernel
                records[(layer, site)] = capture_dense(*kept, **header)
                continue
            sparse = {} if cfg.coding == "dense" else {"tau": cfg.tau, "scale_coding": cfg.scale_coding}
            records[(layer, site)] = capture(kept, quantize(kept, "nvfp4", scale="row"), **header, coding=cfg.coding,
                                             **sparse)
        return records
