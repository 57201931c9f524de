"""The SGLang engine's host process side: `sglang.Engine` running TRACE's FP4 policy.

The engine starts on a model directory holding only TRACE's config (weights arrive through
`update_weights`, as for the built-in engine), with `quantization="trace_fp4"` in FP4 (the
plugin: W4A4 at every FP4 site, TRACE's NVFP4 KV cache). Each sample is one SGLang request with
its own sampling seed (SGLang draws from a seed and the position, so a sample's tokens do not
depend on its batch). Each sample's request returns the routed experts and guidance rows of
every token it ran; after it finishes, its whole sequence is fed once more (the radix cache
holds all of it but, with pages of P tokens, up to P - 1 tail tokens) so that the last token,
which SGLang never runs, is covered too: the trainer sees every token. The guidance rows come
from the scheduler processes in one file per tensor-parallel rank per group. Each
group is an asyncio task on SGLang's event loop (all in flight together), so a group is handed
on as soon as it is done while the others still generate.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from megatron_trace.checkpoint.hf_layout import hf_config
from megatron_trace.guidance import (
    GroupGuidance,
    GuidanceBatch,
    LayerPolicy,
    SampleGuidance,
    capture_dense,
    capture_sparse_sites,
    expert_id_dtype,
)
from megatron_trace.model_config import ModelConfig, full_weight_shapes
from megatron_trace.modes import EnginePrecision
from megatron_trace.rollout import GroupRequest, RolloutOutput, SampleResult, SamplingParams, check_group_ids
from sglang_rollout.engine.sampler import sample_key

from . import capture
from .config import EngineConfig, check_layout, server_args
from .plugin import SEEDED
from .weight_group import free_port
from .weight_payload import LOADER, MODEL_ENV, PACKED_AT_START

CPU_SITE = Path(__file__).with_name("cpu_site")


class Session:
    """sglang.Engine and what TRACE asks of it, inside the engine's host process (see the module
    docstring); `SGLangEngine` is its RolloutBackend face in the caller's process."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig = EngineConfig()):
        check_layout(model_cfg, engine_cfg)
        self.model_cfg, self.engine_cfg = model_cfg, engine_cfg
        self.weight_version = -1 if engine_cfg.checkpoint is None else 0
        self._group_name = None  # the trainer's weight group, once joined (init_weights_update_group)
        self._torn = False  # a bucketed update stopped part way
        self._released = False  # release_memory: SGLang's GPU memory is given back to the trainer
        self._unsent: set[str] = set()  # weights not yet sent again since resume_memory
        self.guided_layers = sorted(LayerPolicy.parse(engine_cfg.guide).select(model_cfg.num_layers))
        self._dir = tempfile.TemporaryDirectory(prefix="trace-sglang-")
        Path(self._dir.name, "config.json").write_text(json.dumps(hf_config(model_cfg)))
        spec = {"layers": self.guided_layers, "coding": engine_cfg.coding, "tau": engine_cfg.tau,
                "scale_coding": engine_cfg.scale_coding}
        args = server_args(self._dir.name, engine_cfg, mla=model_cfg.mla)
        # FP4 sites are created packed only where SGLang's loaders will not fill them (its dummy load,
        # whatever rollout.sglang says), so a load_format given through the options still loads
        env = {capture.ENV: json.dumps(spec), SEEDED: "1", PACKED_AT_START: str(int(args["load_format"] == "dummy")),
               MODEL_ENV: json.dumps(dataclasses.asdict(model_cfg))}
        if engine_cfg.device == "cpu":
            from . import cpu_patches

            cpu_patches.install()
            # TRITON_INTERPRET: SGLang's seeded sampling hashes with a Triton kernel; TRACE's own kernels are
            # called with the torch backend on CPU tensors (quant.kernel_backend)
            env |= {"SGLANG_USE_CPU_ENGINE": "1", "TORCH_COMPILE_DISABLE": "1", "TRITON_INTERPRET": "1",
                    "PYTHONPATH": os.pathsep.join([str(CPU_SITE), os.environ.get("PYTHONPATH", "")])}
            if engine_cfg.tp_size > 1:
                env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % max(1, os.cpu_count())) for i in
                                                              range(engine_cfg.tp_size))
        if args.get("nccl_port") is None:  # SGLang's own pick (bind to port 0) races outgoing connections
            args["nccl_port"] = free_port()
        import sglang

        with _environment(env):  # inherited by the scheduler processes SGLang spawns
            self.engine = sglang.Engine(**args)
        self._calls = 0

    @property
    def precision(self) -> EnginePrecision:
        return self.engine_cfg.precision

    def shutdown(self) -> None:
        """Stop SGLang's processes (also done when the object is collected)."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()

    # -- weights ------------------------------------------------------------------------------
    def load_bucket(self, payloads: list[bytes], version: int, last: bool, names: list[str]) -> None:
        """Load one weight bucket the caller pickled for each tensor-parallel rank
        (weight_payload.serialize_bucket: SGLang's update_weights_from_tensor payloads, read by
        TRACE's loader) of the update to `version`; `version` holds once the `last` is in, and
        `names` (given with the last) are the weights the update sent. The caller checked
        each bucket (weight_payload.checked)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        self._start_bucket(version)
        # the request Engine.update_weights_from_tensor makes, with our payloads: it would pickle the
        # tensors itself, and so need them in this process (a second hop for every bucket)
        request = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format=LOADER,
                                                  flush_cache=last)
        self._applied(self.engine.loop.run_until_complete(
            self.engine.tokenizer_manager.update_weights_from_tensor(request, None)))
        self._end_bucket(version, last, names)

    def _start_bucket(self, version: int) -> None:
        if self._released:
            raise RuntimeError("the engine's memory is released (release_memory): resume_memory before sending weights")
        if version <= self.weight_version:
            raise ValueError(f"weight version {version} is not newer than the engine's {self.weight_version}")
        self._torn = True  # until the last bucket is in, the weights are neither the old nor the new ones

    def _end_bucket(self, version: int, last: bool, names: list[str]) -> None:
        if last:
            self._torn = False
            self._unsent -= set(names)
            self.weight_version = version

    # -- memory (colocated with a trainer) ----------------------------------------------------
    def release_memory(self) -> None:
        """Give SGLang's GPU memory (weights, KV cache, CUDA graphs) to a trainer on the same GPU
        until resume_memory: SGLang's release_memory_occupation, which frees it with
        `enable_memory_saver` (EngineConfig.release_memory, torch_memory_saver) and otherwise runs
        only its bookkeeping (on the CPU). A no-op without EngineConfig.release_memory."""
        if not self.engine_cfg.release_memory or self._released:
            return
        self.engine.release_memory_occupation()
        self._released = True

    def resume_memory(self) -> None:
        """Take the memory back (SGLang's resume_memory_occupation). The weights' contents are not
        kept: generate refuses until every weight has been sent again (update_weights)."""
        if not self._released:
            return
        self.engine.resume_memory_occupation()
        self._released = False
        self._unsent = set(full_weight_shapes(self.model_cfg))

    def init_weights_update_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                                  backend: str) -> None:
        """Join SGLang's scheduler processes to the trainer's weight group (SGLang's
        init_weights_update_group: tensor-parallel rank r becomes rank 1 + r)."""
        self._applied(self.engine.init_weights_update_group(master_address, master_port, 1, world_size, group_name,
                                                            backend), what="the weight group")
        self._group_name = group_name

    def receive_bucket(self, name: str, nbytes: int, version: int, last: bool, names: list[str]) -> None:
        """Receive one weight bucket (`nbytes`, travelling as `name`) the trainer broadcasts over
        the weight group (SGLang's update_weights_from_distributed with TRACE's loader) of the
        update to `version`, as load_bucket takes one."""
        if self._group_name is None:
            raise RuntimeError("receive_bucket before init_weights_update_group")
        self._start_bucket(version)
        self._applied(self.engine.update_weights_from_distributed([name], ["uint8"], [[nbytes]], self._group_name,
                                                                  flush_cache=last, load_format=LOADER))
        self._end_bucket(version, last, names)

    @staticmethod
    def _applied(result, what: str = "the weights") -> None:
        """Raise for SGLang's (success, message) result of a weight call that failed."""
        ok, message = (result[0], result[1]) if isinstance(result, (tuple, list)) else (bool(result), str(result))
        if not ok:
            raise ValueError(f"SGLang refused {what}: {message}")

    def quantization_table(self) -> dict[str, str]:
        """{HF module: "fp4" | "bf16"} of every linear and KV site, as SGLang's model holds them
        (checkpoint.audit's view; under TP, rank 0's)."""
        with tempfile.TemporaryDirectory(prefix="trace-audit-") as tmp:
            self.engine.collective_rpc("trace_quantization_table", path=tmp)
            return json.loads(Path(tmp, "rank0.json").read_text())

    def memory(self) -> list[dict]:
        """Per TP rank, its scheduler process's memory in bytes: {"device", "peak", "now"} (on a
        GPU torch's allocated bytes, at most since the start and now; on the CPU the resident set)."""
        with tempfile.TemporaryDirectory(prefix="trace-memory-") as tmp:
            self.engine.collective_rpc("trace_memory", path=tmp)
            return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(self.engine_cfg.tp_size)]

    # -- generation ---------------------------------------------------------------------------
    def generate(self, requests: list[GroupRequest], sampling: SamplingParams, on_group=None) -> RolloutOutput:
        """Every request's samples, in request order, with routed experts for every token and
        guidance records for the guided layers (prompt records once per group). The groups run
        together in SGLang's batches; on_group(output), if given, receives each group's output as
        soon as its last sample is fed (a refused group at once)."""
        if self.weight_version < 0:
            raise RuntimeError("the engine has no weights yet: call update_weights first")
        if self._torn:
            raise RuntimeError("the engine's weights are a mix of versions (its last update stopped part way): "
                               "it generates again once a whole update is in")
        if self._released:
            raise RuntimeError("the engine's memory is released (release_memory): resume_memory first")
        if self._unsent:
            raise RuntimeError(f"the engine's memory was resumed and {len(self._unsent)} weights were not sent again "
                               f"(e.g. {sorted(self._unsent)[0]}): send every weight first")
        check_group_ids(requests)
        self._calls += 1
        parts = self.engine.loop.run_until_complete(self._run(requests, sampling, on_group))
        return RolloutOutput([s for part in parts for s in part.samples],
                             GuidanceBatch({k: v for part in parts for k, v in part.guidance.groups.items()},
                                           {k: v for part in parts for k, v in part.guidance.samples.items()}))

    async def _run(self, requests, sampling: SamplingParams, on_group) -> list[RolloutOutput]:
        """Each request's output (in request order), every group a task of its own."""
        async def one(req):
            part = await self._group(req, sampling)
            if on_group is not None:
                on_group(part)
            return part
        parts = await asyncio.gather(*(one(req) for req in requests), return_exceptions=True)
        failed = [p for p in parts if isinstance(p, BaseException)]
        if failed:  # after every task has ended, so nothing of this call runs on into the next
            raise failed[0]
        return parts

    async def _group(self, req: GroupRequest, sampling: SamplingParams) -> RolloutOutput:
        """One group: its samples generated, each fed once more, their guidance rows gathered."""
        sids = [f"{req.group_id}/{i}" for i in range(req.n)]
        error = self._check(req, sampling)
        if error:
            return RolloutOutput([SampleResult(sample_id=sid, group_id=req.group_id, prompt_len=len(req.prompt_ids),
                                               tokens=[], logprobs=torch.zeros(0), finish_reason="error",
                                               weight_version=self.weight_version, error=error) for sid in sids])
        outs = await self._generate(req, sids, sampling)
        feeds = await self._feed(req, sids, outs)
        # every token but the last as the sample's own request ran it, the last from its feed
        experts = []
        for feed, out in zip(feeds, outs, strict=True):
            ran = _routed_experts(out["meta_info"]["routed_experts"], len(req.prompt_ids) + len(out["output_ids"]) - 1,
                                  self.model_cfg)
            last = _routed_experts(feed["meta_info"]["routed_experts"], 1, self.model_cfg)
            experts.append({layer: torch.cat([ran[layer], last[layer]]) for layer in ran})
        rows = self._guidance_rows([self._rid(sid) for sid in sids], experts)
        guidance = GuidanceBatch()
        samples = [self._sample(req, sid, out, routed, row, guidance, sampling.stop_token_ids, first=i == 0)
                   for i, (sid, out, routed, row) in enumerate(zip(sids, outs, experts, rows, strict=True))]
        return RolloutOutput(samples, guidance)

    def _rid(self, sample_id: str) -> str:
        return f"{capture.SAMPLE_PREFIX}{self._calls}/{sample_id}"

    def _check(self, req: GroupRequest, sampling: SamplingParams) -> str | None:
        """Why `req` cannot run (None: it can), as the built-in engine says it."""
        n, vocab = len(req.prompt_ids), self.model_cfg.vocab_size
        if n == 0:
            return "empty prompt"
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            return f"token ids {bad[:5]} outside the vocabulary 0..{vocab - 1}"
        if req.n < 1:
            return f"n must be >= 1, got {req.n}"
        limit = min(self.model_cfg.max_position_embeddings, self.engine_cfg.num_blocks * self.engine_cfg.block_size)
        if n + sampling.max_new_tokens + 1 > limit:  # + 1: the feed of the last token
            return (f"prompt of {n} tokens + max_new_tokens {sampling.max_new_tokens} exceeds the context of "
                    f"{limit} tokens")
        return None

    async def _generate(self, req: GroupRequest, sids: list[str], sampling: SamplingParams) -> list[dict]:
        params = [{"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                   "top_p": sampling.top_p, "top_k": sampling.top_k or -1,
                   "stop_token_ids": list(sampling.stop_token_ids),
                   "sampling_seed": sample_key(sampling.seed, sid)} for sid in sids]
        return await self.engine.async_generate(input_ids=[list(req.prompt_ids)] * len(sids), sampling_params=params,
                                                return_logprob=True, return_routed_experts=True,
                                                rid=[self._rid(sid) for sid in sids])

    async def _feed(self, req: GroupRequest, sids: list[str], outs: list[dict]) -> list[dict]:
        """Each finished sample's sequence once more, its last token computed: that token's routed
        experts and guidance rows. The rest comes from the radix cache: all of it with pages of
        one token; with pages of P, the whole pages (SGLang caches a finished request's full pages
        only), the tail recomputed, its rows not taken (the sample's own request has them)."""
        page = int(self.engine_cfg.sglang.get("page_size") or 1)

        async def feed(seq, sid):
            return await self.engine.async_generate(
                input_ids=seq, return_routed_experts=True, routed_experts_start_len=len(seq) - 1,
                sampling_params={"max_new_tokens": 1, "temperature": 0.0, "sampling_seed": 0},
                rid=f"{capture.FEED_PREFIX}{self._rid(sid)}")
        seqs = [list(req.prompt_ids) + list(out["output_ids"]) for out in outs]
        feeds = await asyncio.gather(*(feed(seq, sid) for seq, sid in zip(seqs, sids, strict=True)))
        for seq, out, sid in zip(seqs, feeds, sids, strict=True):
            cached, whole = out["meta_info"].get("cached_tokens", len(seq) - 1), (len(seq) - 1) // page * page
            if cached < whole:
                raise RuntimeError(f"sample {sid}: its KV entries were evicted before its last token was fed "
                                   f"({cached} of {whole} cached): give the engine more KV blocks")
        return feeds

    def _guidance_rows(self, rids: list[str], experts: list[dict]) -> list[dict]:
        """Per sample request, {(layer, site): (bits, scales, g)} of its whole sequence ([] unguided;
        experts: each sample's routed experts, which tell an EP rank's fc2 rows): the rows its own
        request recorded, then its feed's last token. One SGLang RPC (a short pause of the event
        loop: the scheduler answers between batches)."""
        if not self.guided_layers:
            return [{} for _ in rids]
        feeds = [f"{capture.FEED_PREFIX}{rid}" for rid in rids]
        with tempfile.TemporaryDirectory(prefix="trace-guidance-", dir=_spill_dir()) as tmp:
            self.engine.collective_rpc("trace_dump_guidance", rids=rids + feeds, path=tmp)
            ranks = [torch.load(Path(tmp, f"rank{r}.pt"), weights_only=True) for r in range(self.engine_cfg.tp_size)]
        ranks = [{rid: {key: tuple(torch.cat(pair) for pair in zip(ran, rank[feed][key], strict=True))
                        for key, ran in rank[rid].items()} for rid, feed in zip(rids, feeds, strict=True)}
                 for rank in ranks]
        ep = int(self.engine_cfg.sglang.get("ep_size", 1))
        c = self.model_cfg
        dense = frozenset(range(c.num_layers)) - set(c.moe_layers)
        heads = 1 if c.mla else c.num_key_value_heads
        return [capture.merge_ranks([rank[rid] for rank in ranks], heads, ep, routed, c.num_experts, dense)
                for rid, routed in zip(rids, experts, strict=True)]

    def _sample(self, req, sid, out, experts, rows, guidance, stops, first: bool) -> SampleResult:
        meta = out["meta_info"]
        tokens = list(out["output_ids"])
        logprobs = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]], dtype=torch.float32)
        reason = meta["finish_reason"]
        reason = reason["type"] if isinstance(reason, dict) else str(reason)
        p = len(req.prompt_ids)
        experts = {L: e.to(expert_id_dtype(self.model_cfg.num_experts)) for L, e in experts.items()}  # as they travel
        if first:
            guidance.add_group(GroupGuidance(group_id=req.group_id, prompt_len=p,
                                             records=self._records(rows, 0, p, req.group_id),
                                             routed_experts={L: e[:p] for L, e in experts.items()}))
        guidance.add_sample(SampleGuidance(sample_id=sid, group_id=req.group_id, response_len=len(tokens),
                                           weight_version=self.weight_version,
                                           records=self._records(rows, p, p + len(tokens), sid),
                                           routed_experts={L: e[p:] for L, e in experts.items()}))
        # a stop token drawn as the last allowed token: SGLang says "length", the contract "stop"
        stopped = reason == "stop" or bool(tokens) and tokens[-1] in stops
        return SampleResult(sample_id=sid, group_id=req.group_id, prompt_len=p, tokens=tokens, logprobs=logprobs,
                            finish_reason="stop" if stopped else "length", weight_version=self.weight_version)

    def _records(self, rows: dict, start: int, end: int, owner: str) -> dict:
        """Records (EngineConfig.coding) of tokens start..end-1 of a sequence's captured rows."""
        if not rows:
            return {}
        cfg, total = self.engine_cfg, max(1, rows_total(rows))
        header = dict(model_id=cfg.model_id, sample_id=owner, weight_version=self.weight_version, policy=cfg.guide)
        cut = {}
        for key, parts in rows.items():
            per = parts[0].shape[0] // total
            cut[key] = [p[start * per:end * per] for p in parts]
        if cfg.coding == "dense":
            return {(layer, site): capture_dense(*parts, layer=layer, site=site, **header)
                    for (layer, site), parts in cut.items()}
        return capture_sparse_sites(cut, **header, tau=cfg.tau, scale_coding=cfg.scale_coding)


def rows_total(rows: dict) -> int:
    """Tokens a sequence's captured rows cover (the qkv site has one row per token)."""
    for (_, site), parts in rows.items():
        if site == "qkv":
            return parts[0].shape[0]
    raise ValueError("captured rows without the qkv site: cannot tell how many tokens they cover")


def _routed_experts(encoded, tokens: int, model_cfg: ModelConfig) -> dict[int, torch.Tensor]:
    """{layer: int64 [tokens, top_k]} of SGLang's routed experts (base64 int32 [tokens, L, k])."""
    raw = np.frombuffer(base64.b64decode(encoded), dtype=np.int32) if isinstance(encoded, str) else np.asarray(encoded)
    arr = torch.from_numpy(raw.copy()).long().reshape(tokens, model_cfg.num_layers, model_cfg.top_k)
    return {layer: arr[:, layer].contiguous() for layer in model_cfg.moe_layers}  # dense layers route nothing


def _spill_dir() -> str | None:
    """Where guidance files go between the processes: RAM-backed /dev/shm when there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class _environment:
    """Set environment variables for a scope (restored after)."""

    def __init__(self, values: dict):
        self.values, self.saved = values, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

