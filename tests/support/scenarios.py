"""What the Megatron tests run inside each rank (imported by spawned processes)."""

from __future__ import annotations

import dataclasses

import torch

from megatron_trace.guidance import (
    GroupGuidance,
    GuidanceBatch,
    SampleGuidance,
    capture,
)
from tests.support import qwen3_moe_reference as ref
from trace_kernels.fp4 import quantize, unpack_bits, unpack_codes
from trace_kernels.fp4.reference import nvfp4_scaled_values

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SITE_ORDER = ("qkv", "k", "v", "proj", "fc1", "fc2")


def random_full_state_dict(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the one-process Megatron key names (bf16 matrices, fp32 norms)."""
    g = torch.Generator().manual_seed(seed)
    h, d, nq, ng, f = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                       cfg.moe_intermediate_size)

    def mat(rows, cols, std=None):
        return (torch.randn(rows, cols, generator=g) * (std or cols**-0.5)).bfloat16()

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    if cfg.model_type != "qwen3_moe":
        return _random_family_state_dict(cfg, mat, norm, g)
    sd = {"embedding.word_embeddings.weight": mat(cfg.vocab_size, h, 1.0),
          "decoder.final_layernorm.weight": norm(h), "output_layer.weight": mat(cfg.vocab_size, h)}
    for L in range(cfg.num_layers):
        p = f"decoder.layers.{L}."
        sd |= {p + "input_layernorm.weight": norm(h), p + "pre_mlp_layernorm.weight": norm(h),
               p + "self_attention.linear_qkv.weight": mat((nq + 2 * ng) * d, h),
               p + "self_attention.q_layernorm.weight": norm(d), p + "self_attention.k_layernorm.weight": norm(d),
               p + "self_attention.linear_proj.weight": mat(h, nq * d),
               p + "mlp.router.weight": mat(cfg.num_experts, h)}
        for e in range(cfg.num_experts):
            sd[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = mat(2 * f, h)
            sd[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = mat(h, f)
    return sd


def _random_family_state_dict(cfg, mat, norm, g) -> dict[str, torch.Tensor]:
    """random_full_state_dict of a DeepSeek-V3-family config: every tensor of full_weight_shapes,
    matrices BF16, norms FP32 around 1, the routers' expert bias FP32 and non-zero (it picks experts)."""
    from megatron_trace.model_config import full_weight_shapes

    sd = {}
    for name, shape in full_weight_shapes(cfg).items():
        if name == "embedding.word_embeddings.weight":
            sd[name] = mat(*shape, 1.0)
        elif len(shape) == 2:
            sd[name] = mat(*shape)
        elif name.endswith("expert_bias"):
            sd[name] = 0.05 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            sd[name] = (0.1 * torch.randn(shape, generator=g)).bfloat16()
        else:
            sd[name] = norm(shape[0])
    return sd


def make_sequences(cfg, lengths, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]


def engine_rollout(cfg, sd, seqs, prompt_lens, *, layers, coding="dense", version=3):
    """The stand-in engine: float32 FP4 forward, guidance for `layers` and engine codes per site.

    Returns (GuidanceBatch, sample ids, {(layer, site): (codes uint8 [R, K], scale bytes [R, K/16])},
    engine logits float32 [T, V]).
    """
    logits, rows, routed = ref.forward(sd, cfg, seqs, fp4=True, dtype=torch.float32)
    per_token = {"fc2": cfg.top_k, "k": cfg.num_key_value_heads, "v": cfg.num_key_value_heads}
    batch, sample_ids, codes = GuidanceBatch(), [], {}
    bounds = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).tolist()
    quantized = {key: quantize(r, scale="row") for key, r in rows.items()}
    for key, q in quantized.items():
        codes[key] = (unpack_codes(q.codes), q.block_scales.view(torch.uint8))
    for i, (lo, n_prompt) in enumerate(zip(bounds[:-1], prompt_lens, strict=True)):
        hi = bounds[i + 1]
        gid, sid = f"g{i}", f"s{i}"
        group = GroupGuidance(group_id=gid, prompt_len=n_prompt,
                              routed_experts={L: routed[L][lo:lo + n_prompt] for L in range(cfg.num_layers)})
        sample = SampleGuidance(sample_id=sid, group_id=gid, response_len=hi - lo - n_prompt, weight_version=version,
                                routed_experts={L: routed[L][lo + n_prompt:hi] for L in range(cfg.num_layers)})
        for (L, site), r in rows.items():
            if L not in layers:
                continue
            m = per_token.get(site, 1)
            for owner, a, b in ((group, lo, lo + n_prompt), (sample, lo + n_prompt, hi)):
                x = r[a * m:b * m]
                owner_id = owner.group_id if owner is group else owner.sample_id
                owner.records[(L, site)] = capture(x, quantize(x, scale="row"), model_id="tiny", layer=L, site=site,
                                                   sample_id=owner_id, weight_version=version, policy="test",
                                                   coding=coding)
        batch.add_group(group)
        batch.add_sample(sample)
        sample_ids.append(sid)
    return batch, sample_ids, codes, logits


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def packed_inputs(seqs):
    from megatron_trace.megatron.model import pack_sequences

    return pack_sequences(seqs, device())


class CodeChecker:
    """Observer comparing each guided site's codes with the engine's, row by row."""

    def __init__(self, engine_codes_by_batch):
        self.engine_codes = engine_codes_by_batch
        self.mismatch: dict = {}
        self.checked: dict = {}
        self.shipped_mismatch: dict = {}
        self.shipped: dict = {}

    def __call__(self, site, x, q, guidance):
        if guidance is None or guidance.row_ids is None:
            return
        key = (site.layer, site.name)
        ids = guidance.row_ids.cpu()
        ec = torch.empty(len(ids), q.shape[1], dtype=torch.uint8)
        es = torch.empty(len(ids), q.shape[1] // 16, dtype=torch.uint8)
        for b in (ids >> 32).unique().tolist():
            sel = (ids >> 32) == b
            codes, scales = self.engine_codes[b][key]
            lo, hi = site.cols.span(codes.shape[1]) if site.cols is not None else (0, codes.shape[1])
            rows = ids[sel] & 0xFFFFFFFF
            ec[sel], es[sel] = codes[rows][:, lo:hi], scales[rows][:, lo // 16:hi // 16]
        tc = unpack_codes(q.codes).cpu()
        # -0 and +0 are the same value; everything else must be the engine's code exactly
        bad = (tc != ec) & ~(((tc & 7) == 0) & ((ec & 7) == 0))
        bad_scales = q.block_scales.view(torch.uint8).cpu() != es
        self.mismatch[key] = self.mismatch.get(key, 0) + int(bad.sum()) + int(bad_scales.sum())
        self.checked[key] = self.checked.get(key, 0) + ids.numel()
        if guidance.bit_known is not None:  # sparse: shipped elements must get the engine's code
            shipped = unpack_bits(guidance.bit_known.cpu()).bool().reshape(bad.shape)
            # ... whenever one bit can name it: same block scale, and the engine's magnitude is
            # one of the two grid neighbours of the trainer's value with the right sign (docs/design.md 4.2);
            # larger drift (after an earlier unshipped flip) is beyond what guidance promises
            g, scales, _ = guidance.resolve(x)
            v = nvfp4_scaled_values(x.float(), g, scales).cpu().double()
            grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
            av = v.abs().clamp(max=6.0)
            lower = grid[(grid[None, None, :] <= av[..., None]).sum(-1) - 1]
            upper = grid[len(grid) - (grid[None, None, :] >= av[..., None]).sum(-1)]
            m_e = grid[(ec & 7).long()]
            sign_ok = (m_e == 0) | ((ec >= 8) == (v < 0))
            reachable = ((m_e == lower) | (m_e == upper)) & sign_ok & (~bad_scales).repeat_interleave(16, dim=1)
            self.shipped_mismatch[key] = self.shipped_mismatch.get(key, 0) + int((bad & shipped & reachable).sum())
            self.shipped[key] = self.shipped.get(key, 0) + int(shipped.sum())


def run_layout(rank, *, cfg, sd, batches, modes, dispatcher="alltoall", recompute=None, backward=False,
               params_dtype=torch.bfloat16, grouped_gemm=False, checkpoint=None, transformer_impl="local"):
    """Build this rank's stage (on Megatron's `transformer_impl`), load `sd` (or the Megatron
    checkpoint directory `checkpoint`), and for each of this data-parallel rank's batches
    (batches[dp_rank::dp_size]; a batch is a dict with "seqs" and, for trace mode, "guidance",
    "sample_ids", "codes") run each mode's forward, and backward after the last mode.

    Returns {batch index: {"logits": {mode: float32 [T, V]} (last stage, TP-gathered),
             "mismatch"/"checked": per-site counts of the trace mode's CodeChecker,
             "grads_finite": bool, "grads": {global name: float32 grad}}}.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import (
        gather_from_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_trace.megatron import qat
    from megatron_trace.megatron.context import MicroBatchGuidance
    from megatron_trace.megatron.model import build_model, set_precision
    from megatron_trace.megatron.trainer import linears_for
    from megatron_trace.megatron.weights import global_name, load_full_state_dict

    model = build_model(cfg, "bf16", dispatcher=dispatcher, recompute=recompute, params_dtype=params_dtype,
                        grouped_gemm=grouped_gemm, linears=linears_for(transformer_impl))
    if checkpoint is None:
        load_full_state_dict(model, sd)
    else:
        from megatron_trace.checkpoint.dist import load_model

        load_model(model, checkpoint)
    offset = get_transformer_layer_offset(model.config)
    stage_layers = range(offset, offset + len(model.decoder.layers))
    dp, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    results = {}
    for index in range(dp, len(batches), dp_size):
        batch = batches[index]
        ids, pos, psp = packed_inputs(batch["seqs"])
        T = ids.shape[1]
        guidance = None
        if "guidance" in batch:
            guidance = MicroBatchGuidance.from_batch(batch["guidance"], batch["sample_ids"], layers=stage_layers)
            # number rows globally (batch index in the high bits): expert parallelism brings
            # other data-parallel ranks' tokens, which the checker must look up in their batch
            guidance.sites = {k: dataclasses.replace(v, row_ids=v.row_ids + (index << 32))
                              for k, v in guidance.sites.items()}
            guidance = guidance.to(device())
        out = results[index] = {"logits": {}, "mismatch": {}, "checked": {}, "grads_finite": None, "grads": {}}
        checker = CodeChecker([b.get("codes") for b in batches]) if "codes" in batch else None
        for mode in modes:
            set_precision(model, mode)
            collected = []

            def fwd_step(data_iter, model, mode=mode, ids=ids, pos=pos, psp=psp, guidance=guidance,
                         collected=collected):
                next(data_iter)
                o = model(ids, pos, None, packed_seq_params=psp, guidance=guidance if mode == "fp4-guided" else None)

                def loss_func(output):
                    collected.append(output.detach())
                    # mean of squared logits over the whole vocabulary, the same under any TP
                    sq = reduce_from_tensor_model_parallel_region(output.float().square().sum(-1))
                    return sq.mean() / output.shape[-1] / ps.get_tensor_model_parallel_world_size(), {}
                return o, loss_func

            do_backward = backward and mode == modes[-1]
            if checker is not None and mode == "fp4-guided":
                qat.observers.append(checker)
            try:
                model.zero_grad()
                get_forward_backward_func()(forward_step_func=fwd_step, data_iterator=iter([0]), model=[model],
                                            num_microbatches=1, seq_length=T, micro_batch_size=1,
                                            forward_only=not do_backward)
            finally:
                qat.observers.clear()
            if ps.is_pipeline_last_stage():
                out["logits"][mode] = (gather_from_tensor_model_parallel_region(collected[0])
                                       .reshape(T, -1).float().cpu())
            if do_backward:
                for p in model.parameters():  # as finalize_model_grads does for sequence-parallel params
                    if getattr(p, "sequence_parallel", False) and p.grad is not None:
                        torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
                grads = {global_name(n, model): p.grad.float().cpu()
                         for n, p in model.named_parameters() if p.grad is not None}
                out["grads_finite"] = bool(grads) and all(bool(torch.isfinite(g).all()) for g in grads.values())
                out["grads"] = grads
        if checker is not None:
            out["mismatch"], out["checked"] = checker.mismatch, checker.checked
            out["shipped_mismatch"], out["shipped"] = checker.shipped_mismatch, checker.shipped
    return results


def run_routing_replay(rank, *, cfg, sd, seqs, routed):
    """Forward with the given expert ids; returns {layer: the routing map the router produced}."""
    from megatron_trace.megatron.context import MicroBatchGuidance
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.weights import load_full_state_dict

    model = build_model(cfg, "fp4-rne")
    load_full_state_dict(model, sd)
    seen = {}
    for layer in model.decoder.layers:
        layer.mlp.router.register_forward_hook(
            lambda mod, args, out, li=layer.layer_number - 1: seen.__setitem__(li, out[1].detach().clone()))
    ids, pos, psp = packed_inputs(seqs)
    guidance = MicroBatchGuidance(ids.shape[1], routed_experts=routed).to(device())
    model(ids, pos, None, packed_seq_params=psp, guidance=guidance)
    return {k: v.cpu() for k, v in seen.items()}


def run_plain_megatron(rank, *, cfg, sd, tokens):
    """Logits [S, V] of one unpacked sequence from Megatron's own local-spec GPTModel (no TRACE
    modules) and from the TRACE model in bf16 mode, with the same weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_trace.megatron.model import build_model, transformer_config
    from megatron_trace.megatron.weights import load_full_state_dict

    spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    plain = GPTModel(config=transformer_config(cfg, moe_enable_routing_replay=False), transformer_layer_spec=spec,
                     vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                     position_embedding_type="rope", rotary_base=int(cfg.rope_theta))
    ours = build_model(cfg, "bf16")
    n = len(tokens)
    if torch.cuda.is_available():
        plain.cuda()
    ids, pos = tokens[None].to(device()), torch.arange(n)[None].to(device())
    causal = torch.ones(n, n, dtype=torch.bool, device=device()).triu(1)[None, None]  # True = masked
    out = []
    with torch.no_grad():
        for model in (plain, ours):
            load_full_state_dict(model, sd)
            out.append(model(ids, pos, causal).reshape(n, -1).float().cpu())
    return out


def run_weight_codes(rank, *, cfg, sd):
    """Sharded FP4 weight quantization vs the full tensor's: count of differing codes/scales per site."""
    from megatron_trace.megatron.model import build_model, fp4_sites
    from megatron_trace.megatron.qat import all_reduce_max
    from megatron_trace.megatron.weights import (
        global_name,
        load_full_state_dict,
        shard_of,
    )
    from trace_kernels.fp4 import quantize

    model = build_model(cfg, "fp4-rne")
    load_full_state_dict(model, sd)
    sites = {id(s): s for s in fp4_sites(model)}
    diffs, compared = {}, 0
    for name, mod in model.named_modules():
        site = getattr(mod, "fp4_site", None)
        if site is None or id(site) not in sites:
            continue
        w = mod.weight.detach()
        amax = all_reduce_max(w.abs().amax().float(), site.weight_group)
        local = quantize(w, global_amax=amax).to("cpu")
        full_name = global_name(name + ".weight", model)
        full = quantize(sd[full_name])
        want_codes = shard_of(unpack_codes(full.codes), full_name)
        want_scales = shard_of(full.block_scales.view(torch.uint8), full_name)
        diffs[full_name] = int((unpack_codes(local.codes) != want_codes).sum()
                               + (local.block_scales.view(torch.uint8) != want_scales).sum()
                               + (local.global_scale != full.global_scale).sum())
        compared += 1
    return diffs, compared


def run_token_logprobs(rank, *, cfg, sd, seqs):
    """(token_logprobs [T], gathered logits [T, V]) of the fp4 model for next-token targets."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_trace.megatron.model import build_model, token_logprobs
    from megatron_trace.megatron.weights import load_full_state_dict

    model = build_model(cfg, "fp4-rne")
    load_full_state_dict(model, sd)
    ids, pos, psp = packed_inputs(seqs)
    targets = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        lp = token_logprobs(model, ids, pos, targets, packed_seq_params=psp)
        logits = gather_from_tensor_model_parallel_region(model(ids, pos, None, packed_seq_params=psp))
    return lp.reshape(-1).cpu(), logits.reshape(ids.shape[1], -1).float().cpu(), targets.reshape(-1).cpu()


def run_rollout_replay(rank, *, cfg, sd, prompts, samples, guidance, grouped_gemm=False):
    """The Megatron trainer's log-probs of each rollout sample's response (prompts: group id ->
    prompt ids) in fp4-rne and in trace mode (guided by the rollout's guidance, routing replayed),
    with the flip rates of each: {precision: ([float32 [response_len]], rates)}."""
    from megatron_trace.megatron import qat
    from megatron_trace.megatron.context import MicroBatchGuidance
    from megatron_trace.megatron.model import build_model, set_precision, token_logprobs
    from megatron_trace.megatron.weights import load_full_state_dict
    from megatron_trace.rl.mismatch import FlipCounter

    model = build_model(cfg, "bf16", grouped_gemm=grouped_gemm)
    load_full_state_dict(model, sd)
    seqs = [torch.tensor(list(prompts[s.group_id]) + s.tokens) for s in samples]
    ids, pos, psp = packed_inputs(seqs)
    mb = MicroBatchGuidance.from_batch(guidance, [s.sample_id for s in samples]).to(device())
    out = {}
    for precision in ("fp4-rne", "fp4-guided"):
        set_precision(model, precision)
        counter = FlipCounter()
        qat.observers.append(counter)
        try:
            with torch.no_grad():
                lp = token_logprobs(model, ids, pos, torch.roll(ids, -1, 1), packed_seq_params=psp,
                                    guidance=mb if precision == "fp4-guided" else None).reshape(-1).cpu()
        finally:
            qat.observers.clear()
        parts, offset = [], 0
        for s, seq in zip(samples, seqs, strict=True):
            parts.append(lp[offset + s.prompt_len - 1: offset + len(seq) - 1])
            offset += len(seq)
        out[precision] = (parts, counter.rates())
    return out


def run_misuse(rank, *, cfg, sd, batch):
    """Error messages of guidance that does not fit the micro-batch it is applied to."""
    from megatron_trace.megatron.context import MicroBatchGuidance
    from megatron_trace.megatron.model import build_model
    from megatron_trace.megatron.weights import load_full_state_dict

    model = build_model(cfg, "fp4-guided")
    load_full_state_dict(model, sd)
    ids, pos, psp = packed_inputs(batch["seqs"])
    good = MicroBatchGuidance.from_batch(batch["guidance"], batch["sample_ids"])
    cases = {
        "one sample short": MicroBatchGuidance.from_batch(batch["guidance"], batch["sample_ids"][:1]),
        "expert id out of range": MicroBatchGuidance(good.num_tokens, good.sites,
                                                     {k: v + cfg.num_experts for k, v in good.routed_experts.items()}),
        "fc2 without routing replay": MicroBatchGuidance(good.num_tokens, good.sites, {}),
        "expert ids repeated": MicroBatchGuidance(good.num_tokens, good.sites,
                                                  {k: v[:, :1].expand_as(v) for k, v in good.routed_experts.items()}),
    }
    errors = {}
    for name, guidance in cases.items():
        try:
            with torch.no_grad():
                model(ids, pos, None, packed_seq_params=psp, guidance=guidance.to(device()))
            errors[name] = None
        except ValueError as e:  # GuidanceFormatError is a ValueError
            errors[name] = str(e)
    return errors


def sparse_ships_dense_bits(dense, sparse, scale_coding: str) -> int:
    """Assert that the sparse-coded guidance of a rollout (RolloutOutput) ships exactly the dense
    one's mantissa bits at the positions it lists, the same global scales, and the block scales
    its scale coding keeps (the dense records of the same tokens are the reference for what the
    rows were); returns the mantissa bits shipped."""
    from megatron_trace.guidance import decode_positions
    from trace_kernels.fp4 import unpack_bits

    assert [s.tokens for s in sparse.samples] == [s.tokens for s in dense.samples]
    owners = [(d.records, sparse.guidance.samples[sid].records) for sid, d in dense.guidance.samples.items()]
    owners += [(d.records, sparse.guidance.groups[gid].records) for gid, d in dense.guidance.groups.items()]
    shipped = 0
    for d_records, s_records in owners:
        assert d_records.keys() == s_records.keys()
        for key, d in d_records.items():
            s = s_records[key]
            assert (s.header.rows, s.header.cols) == (d.header.rows, d.header.cols) and s.header.coding == "sparse"
            assert torch.equal(s.payload["g"], d.payload["g"])
            pos = decode_positions(s.payload["elem_pos"], s.header.n_elems, d.header.rows * d.header.cols)
            want = unpack_bits(d.payload["bits"]).reshape(-1)[pos]
            got = unpack_bits(s.payload["elem_bits"][None]).reshape(-1)[:pos.numel()]
            assert torch.equal(got, want), key
            scales = d.payload["scales"].reshape(-1)
            if scale_coding == "lsb":
                assert torch.equal(unpack_bits(s.payload["scale_bits"][None]).reshape(-1)[:scales.numel()], scales & 1)
            else:
                spos = decode_positions(s.payload["scale_pos"], s.header.n_scales, scales.numel())
                assert torch.equal(s.payload["scale_val"], scales[spos])
            shipped += pos.numel()
    return shipped
