"""Architecture of a MoE model, shared by the trainer, the engines and `trace-rl plan`.

One config for the three HF families TRACE knows (`model_type`): Qwen3-MoE (GQA with q/k norm,
softmax top-k), and the DeepSeek-V3 family's pieces (multi-head latent attention, shared experts,
dense leading layers, sigmoid routing with an expert-bias correction and group-limited top-k) that
DeepSeek-V3 and GLM-4.5 use. Field names follow the HF config's meaning; `from_hf` reads one.
The Megatron trainer and the built-in engine build the family, the SGLang engine Qwen3-MoE and
DeepSeek-V3's pieces (not GLM-4.5's attention), the DeepSpeed trainer Qwen3-MoE alone:
`ModelConfig.unbuilt_in` names what a config asks for that a part lacks, and that part refuses
the config with it (`trace-rl plan` sizes it all the same).

Presets: `tiny` (tests), `demo` (the embedded default), `small` (CPU memory checks), `moe-0.4b` (the
one-GPU RL experiment), `qwen3-30b-a3b`, `qwen3-235b-a22b`, `deepseek-v3` (plan only).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Full-state-dict names of the weights at FP4 sites (docs/design.md sections 3 and 3.1), most
# specific suffix first; the rest stay BF16. suffix -> guidance site (guidance.record.SITES)
FP4_WEIGHT_SITES = {"shared_experts.linear_fc1.weight": "fc1", "shared_experts.linear_fc2.weight": "shared_fc2",
                    "linear_qkv.weight": "qkv", "linear_q_down_proj.weight": "qkv", "linear_kv_down_proj.weight": "qkv",
                    "linear_q_proj.weight": "qkv", "linear_q_up_proj.weight": "q_up",
                    "linear_kv_up_proj.weight": "kv_up",
                    "linear_proj.weight": "proj", "linear_fc1.weight": "fc1", "linear_fc2.weight": "fc2"}
FP4_WEIGHT_SUFFIXES = tuple(FP4_WEIGHT_SITES)


def fp4_site_of(name: str) -> tuple[int, str] | None:
    """(layer, site) of a full weight name at an FP4 site, None for weights that stay BF16."""
    for suffix, site in FP4_WEIGHT_SITES.items():
        if name.endswith(suffix):
            return int(name.split(".")[2]), site
    return None


# weights quantized as one logical tensor (one global scale) though stored apart: MLA's query and KV
# down projections, which the engine runs as one GEMM on one input (docs/design.md section 3.1)
_PEER_SUFFIXES = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")


def fp4_weight_peers(name: str, cfg: ModelConfig) -> tuple[str, ...]:
    """The full names of the weights that share `name`'s FP4 global scale, `name` included in
    order; () for a weight quantized alone (MLA without a query latent: `linear_q_proj` and the KV
    down projection keep their own)."""
    if not cfg.q_lora_rank:
        return ()
    for suffix in _PEER_SUFFIXES:
        if name.endswith(suffix):
            prefix = name[: -len(suffix)]
            return tuple(prefix + s for s in _PEER_SUFFIXES)
    return ()


MODEL_TYPES = ("qwen3_moe", "deepseek_v3", "glm4_moe")  # HF config model_type
SCORING = ("softmax", "sigmoid")
PARTS = ("megatron", "engine", "sglang", "all")  # ModelConfig.unbuilt_in


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a MoE model (field names follow the HF config's meaning; the defaults are
    Qwen3-MoE's). `head_dim` is the query/key head width (MLA: qk_nope_head_dim + qk_rope_head_dim)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    model_type: str = "qwen3_moe"
    # attention: GQA unless kv_lora_rank > 0 (multi-head latent attention, DeepSeek-V2/V3)
    attention_bias: bool = False  # q/k/v biases (GLM-4.5)
    use_qk_norm: bool = True  # RMSNorm over each q and k head (Qwen3)
    partial_rotary_factor: float = 1.0  # the share of each head that RoPE turns (GLM-4.5: 0.5)
    q_lora_rank: int = 0  # MLA's query down-projection rank; 0: queries projected directly (HF: null)
    kv_lora_rank: int = 0  # MLA's compressed KV latent, what its KV cache holds; 0: GQA
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0  # MLA's decoupled RoPE part of each q/k head, one shared key part
    v_head_dim: int = 0
    # FFN: the first first_k_dense_replace layers dense (intermediate_size), the rest MoE
    first_k_dense_replace: int = 0
    intermediate_size: int = 0
    n_shared_experts: int = 0  # shared experts beside the routed ones, moe_intermediate_size wide each
    # router: softmax over all experts then top-k (Qwen3), or sigmoid scores + a bias that only picks
    # (aux-loss-free balancing) with top-k within the best topk_group of n_group expert groups
    scoring_func: str = "softmax"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    rope_type: str = "default"  # HF rope_scaling's type (DeepSeek-V3: yarn)
    # YaRN (rope_type "yarn", HF rope_scaling's keys): the context extension factor, the pre-training
    # context, the ramp's rotation bounds, and the two mscales (cos/sin scaled by yarn_mscale(factor,
    # mscale) / yarn_mscale(factor, mscale_all_dim), the softmax scale by yarn_mscale(factor, mscale_all_dim)^2)
    rope_factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "head_dim", "moe_intermediate_size"):
            if getattr(self, name) % 16:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be a multiple of 16 (NVFP4 blocks)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("ModelConfig.num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"ModelConfig.top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"ModelConfig.model_type={self.model_type!r}: one of {MODEL_TYPES}")
        if self.scoring_func not in SCORING:
            raise ValueError(f"ModelConfig.scoring_func={self.scoring_func!r}: one of {SCORING}")
        if self.mla:
            parts = (self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
            if min(parts) <= 0 or self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
                raise ValueError(f"ModelConfig: MLA (kv_lora_rank={self.kv_lora_rank}) needs qk_nope_head_dim, "
                                 f"qk_rope_head_dim and v_head_dim > 0 and head_dim = qk_nope + qk_rope, got "
                                 f"{parts} and head_dim={self.head_dim}")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"ModelConfig: n_group={self.n_group} must divide num_experts={self.num_experts} and "
                             f"topk_group={self.topk_group} be in 1..n_group")
        if self.rope_type == "yarn" and (self.rope_factor <= 1 or self.original_max_position_embeddings <= 0):
            raise ValueError(f"ModelConfig: YaRN needs rope_factor > 1 and original_max_position_embeddings > 0, got "
                             f"{self.rope_factor} and {self.original_max_position_embeddings}")
        if self.rope_type == "yarn" and not self.mscale_all_dim and self.mscale != 1:
            # transformers then ignores mscale, Megatron does not: no one arithmetic to follow
            raise ValueError(f"ModelConfig: YaRN with mscale={self.mscale} needs mscale_all_dim > 0")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(f"ModelConfig.first_k_dense_replace={self.first_k_dense_replace} must be in "
                             f"0..num_layers={self.num_layers}")
        if self.first_k_dense_replace and (self.intermediate_size <= 0 or self.intermediate_size % 16):
            raise ValueError(f"ModelConfig.intermediate_size={self.intermediate_size}: the dense layers' FFN "
                             "width must be a positive multiple of 16")

    def replace(self, **changes) -> ModelConfig:
        """A copy with `changes` applied (checked like a new one)."""
        return dataclasses.replace(self, **changes)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3) rather than GQA."""
        return self.kv_lora_rank > 0

    def _pieces(self) -> list[tuple[str, bool, bool, bool]]:
        """(what, asked for by this config, built by the Megatron trainer and the built-in engine,
        built by the SGLang engine) for each piece beyond Qwen3-MoE's. The DeepSpeed trainer builds
        none of them yet."""
        c = self
        # Megatron scores a group by the sum of its top (top_k / topk_group) biased scores, the
        # reference by its top two: the same groups only when top_k == 2 * topk_group (DeepSeek-V3: 8, 4)
        groups_as_reference = c.top_k == 2 * c.topk_group
        yarn_on_mla = c.rope_type == "yarn" and c.mla  # YaRN on MLA's rope part (Megatron's MLA has it)
        return [
            (f"multi-head latent attention (kv_lora_rank={c.kv_lora_rank})", c.mla, True, True),
            (f"shared experts (n_shared_experts={c.n_shared_experts})", c.n_shared_experts > 0, True, True),
            (f"dense leading layers (first_k_dense_replace={c.first_k_dense_replace})", c.first_k_dense_replace > 0,
             True, True),
            ("sigmoid routing with an expert-bias correction (scoring_func='sigmoid')", c.scoring_func == "sigmoid",
             True, True),
            (f"group-limited top-k (n_group={c.n_group}, topk_group={c.topk_group}, top_k={c.top_k})", c.n_group > 1,
             groups_as_reference, groups_as_reference),
            (f"scaled routed gates (routed_scaling_factor={c.routed_scaling_factor})", c.routed_scaling_factor != 1,
             True, True),
            ("unnormalised top-k gates (norm_topk_prob=False)", not c.norm_topk_prob, False, False),
            # GLM-4.5's attention: SGLang's Glm4Moe model is not aligned with the trainer yet
            ("attention biases (attention_bias=True)", c.attention_bias, True, False),
            ("attention without q/k norm (use_qk_norm=False)", not c.use_qk_norm and not c.mla, True, False),
            (f"partial rotary embeddings (partial_rotary_factor={c.partial_rotary_factor})",
             c.partial_rotary_factor != 1.0, True, False),
            (f"{c.rope_type} RoPE scaling (rope_scaling)", c.rope_type != "default", yarn_on_mla, yarn_on_mla)]

    def unbuilt_in(self, part: str) -> str:
        """What this architecture asks for that `part` of TRACE does not build yet (empty: it
        builds everything asked). part: "megatron" (the Megatron trainer and its checkpoints),
        "engine" (the built-in engine: the same pieces), "sglang" (the SGLang engine) or "all"
        (also the DeepSpeed trainer, which builds Qwen3-MoE alone)."""
        if part not in PARTS:
            raise ValueError(f"ModelConfig.unbuilt_in: part must be one of {PARTS}, got {part!r}")
        missing = [what for what, asked, trainer, sglang in self._pieces()
                   if asked and not {"megatron": trainer, "engine": trainer, "sglang": sglang}.get(part, False)]
        return ", ".join(missing) + (" are" if len(missing) > 1 else " is") + " not built yet" if missing else ""

    @property
    def unbuilt(self) -> str:
        """What some part of TRACE (trainers, engines) does not build of this architecture yet
        (empty: everything is built); `trace-rl train` refuses the config with it."""
        return self.unbuilt_in("all")

    def require_built(self, what: str, part: str = "all") -> None:
        """ValueError naming `what` (a trainer, an engine) and what `part` does not build, if anything."""
        if missing := self.unbuilt_in(part):
            raise ValueError(f"{what} cannot build this {self.model_type} model: {missing} "
                             "(`trace-rl plan` sizes it)")

    @property
    def attention_linear_params(self) -> int:
        """Weights of one layer's attention linears (all FP4 sites)."""
        h, d, nq, ng = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        if not self.mla:
            return h * d * (nq + 2 * ng) + nq * d * h
        q = h * self.q_lora_rank + self.q_lora_rank * nq * d if self.q_lora_rank else h * nq * d
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * nq * (
            self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + nq * self.v_head_dim * h

    @property
    def attention_other_params(self) -> int:
        """One layer's attention parameters outside the linears' weights: norms and biases (BF16)."""
        if self.mla:
            return self.q_lora_rank + self.kv_lora_rank  # q_a and kv_a layernorms
        d = self.head_dim
        return (2 * d if self.use_qk_norm else 0) + (
            (self.num_attention_heads + 2 * self.num_key_value_heads) * d if self.attention_bias else 0)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer` has experts (the first first_k_dense_replace layers have a dense FFN)."""
        return layer >= self.first_k_dense_replace

    def rows_per_token(self, layer: int, site: str) -> int:
        """Rows per token of an FP4 site's input (its guidance rows): KV heads for k and v, the
        routed experts for a MoE layer's fc2, else one (the shared experts' fc2 is one FFN, as
        Megatron builds them)."""
        if site in ("k", "v"):
            return self.num_key_value_heads
        return self.top_k if site == "fc2" and self.is_moe_layer(layer) else 1

    @property
    def moe_layers(self) -> list[int]:
        """The layers with experts, ascending (routed experts are recorded for these)."""
        return [L for L in range(self.num_layers) if self.is_moe_layer(L)]

    @property
    def shared_expert_size(self) -> int:
        """The shared experts' intermediate width, all of them as one FFN (0: none)."""
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def num_params(self) -> int:
        """Parameters of the whole model (the expert-bias correction, a buffer that a rule updates,
        and DeepSeek-V3's multi-token-prediction module are not counted)."""
        h = self.hidden_size
        per_layer = self.attention_linear_params + self.attention_other_params + 2 * h
        moe = self.num_experts * (3 * h * self.moe_intermediate_size + h) + 3 * h * self.shared_expert_size
        layers = sum(per_layer + (moe if self.is_moe_layer(L) else 3 * h * self.intermediate_size)
                     for L in range(self.num_layers))
        return layers + self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h


# ModelConfig field -> HF config key, where they differ (per model_type: DeepSeek's expert count)
_HF_KEYS = {"num_layers": "num_hidden_layers", "top_k": "num_experts_per_tok"}
_HF_EXPERTS = {"qwen3_moe": "num_experts", "deepseek_v3": "n_routed_experts", "glm4_moe": "n_routed_experts"}
_HF_SCORING = {"qwen3_moe": "softmax", "deepseek_v3": "sigmoid", "glm4_moe": "sigmoid"}  # fixed by the model code
_HF_YARN = {"rope_factor": "factor", "original_max_position_embeddings": "original_max_position_embeddings",
            "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim"}
_REQUIRED = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "moe_intermediate_size",
             "num_experts", "top_k")


def from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of an HF config.json dict (model_type qwen3_moe, deepseek_v3 or glm4_moe).

    Raises:
        ValueError: naming a missing field or a value no TRACE model has (another activation, a
            sliding window, Qwen3's dense `mlp_only_layers` or `decoder_sparse_step`).
    """
    kind = hf.get("model_type", "qwen3_moe")
    if kind not in MODEL_TYPES:
        raise ValueError(f"HF config model_type={kind!r}; TRACE knows {MODEL_TYPES}")
    hf = dict(hf)
    # transformers 5 writes rope_parameters and num_local_experts; the Hub's config.json the older names
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    hf.setdefault("rope_theta", rope.get("rope_theta"))
    hf.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor"))
    hf.setdefault(_HF_EXPERTS[kind], hf.get("num_local_experts"))
    keys = _HF_KEYS | {"num_experts": _HF_EXPERTS[kind]}
    if missing := [keys.get(f, f) for f in _REQUIRED if hf.get(keys.get(f, f)) is None]:
        raise ValueError(f"HF config ({kind}) lacks {missing}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF config has hidden_act={hf['hidden_act']!r}; TRACE's experts are SwiGLU (silu)")
    if hf.get("use_sliding_window"):
        raise ValueError("HF config has use_sliding_window=true; TRACE attends over the whole context")
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError("HF config has Qwen3 dense layers (mlp_only_layers / decoder_sparse_step); TRACE's "
                         "dense layers are the leading ones (first_k_dense_replace)")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    out = {f: hf[keys.get(f, f)] for f in fields if hf.get(keys.get(f, f)) is not None}
    out |= {"model_type": kind, "scoring_func": _HF_SCORING[kind], "q_lora_rank": hf.get("q_lora_rank") or 0,
            "rope_type": rope.get("rope_type", rope.get("type", "default")),
            **{f: rope[k] for f, k in _HF_YARN.items() if rope.get(k) is not None},
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False))}
    if kind == "deepseek_v3":
        out |= {"head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], "use_qk_norm": False}
    elif kind == "glm4_moe":
        out.setdefault("use_qk_norm", False)
    out.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])  # as transformers defaults it
    out.setdefault("num_key_value_heads", hf["num_attention_heads"])
    if not out.get("first_k_dense_replace"):
        out.pop("intermediate_size", None)  # Qwen3 writes a dense width no layer of its MoE uses
    return ModelConfig(**out)


def full_weight_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's (and the routers' expert-bias buffers') full Megatron name
    (megatron/weights.py) and shape, in a fixed order."""
    c = model_cfg
    c.require_built("Megatron's weights", "megatron")
    h, d, nq, ng, f = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.moe_intermediate_size
    shapes = {"embedding.word_embeddings.weight": (c.vocab_size, h), "decoder.final_layernorm.weight": (h,),
              "output_layer.weight": (c.vocab_size, h)}
    for L in range(c.num_layers):
        p = f"decoder.layers.{L}."
        a = p + "self_attention."
        shapes |= {p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,)}
        if c.mla:
            if c.q_lora_rank:
                shapes |= {a + "linear_q_down_proj.weight": (c.q_lora_rank, h),
                           a + "q_layernorm.weight": (c.q_lora_rank,),
                           a + "linear_q_up_proj.weight": (nq * d, c.q_lora_rank)}
            else:
                shapes[a + "linear_q_proj.weight"] = (nq * d, h)
            shapes |= {a + "linear_kv_down_proj.weight": (c.kv_lora_rank + c.qk_rope_head_dim, h),
                       a + "kv_layernorm.weight": (c.kv_lora_rank,),
                       a + "linear_kv_up_proj.weight": (nq * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
                       a + "linear_proj.weight": (h, nq * c.v_head_dim)}
        else:
            shapes[a + "linear_qkv.weight"] = ((nq + 2 * ng) * d, h)
            if c.attention_bias:
                shapes[a + "linear_qkv.bias"] = ((nq + 2 * ng) * d,)
            if c.use_qk_norm:
                shapes |= {a + "q_layernorm.weight": (d,), a + "k_layernorm.weight": (d,)}
            shapes[a + "linear_proj.weight"] = (h, nq * d)
        if not c.is_moe_layer(L):
            shapes |= {p + "mlp.linear_fc1.weight": (2 * c.intermediate_size, h),
                       p + "mlp.linear_fc2.weight": (h, c.intermediate_size)}
            continue
        shapes[p + "mlp.router.weight"] = (c.num_experts, h)
        if c.scoring_func == "sigmoid":
            shapes[p + "mlp.router.expert_bias"] = (c.num_experts,)
        for e in range(c.num_experts):
            shapes[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * f, h)
            shapes[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, f)
        if c.n_shared_experts:
            shapes |= {p + "mlp.shared_experts.linear_fc1.weight": (2 * c.shared_expert_size, h),
                       p + "mlp.shared_experts.linear_fc2.weight": (h, c.shared_expert_size)}
    return shapes


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, moe_intermediate_size=32, num_experts=4, top_k=2, rope_theta=10000.0,
                        max_position_embeddings=512),
    # the embedded default: the built-in tasks' 20-token alphabet, a little wider than "tiny"
    "demo": ModelConfig(vocab_size=32, hidden_size=128, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, moe_intermediate_size=64, num_experts=4, top_k=2, rope_theta=10000.0,
                        max_position_embeddings=512),
    # CPU-sized (28 M parameters, the demo's alphabet): memory and speed checks of whole runs
    "small": ModelConfig(vocab_size=32, hidden_size=512, num_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=64, moe_intermediate_size=256, num_experts=16, top_k=4, rope_theta=10000.0,
                         max_position_embeddings=512),
    # the headline RL experiment on one GPU (bench/rl_experiment.py): Qwen3-MoE-shaped (GQA with
    # head_dim 128, top-4 of 32 experts, 12 layers), 0.42 B parameters (73 M active per token), the
    # built-in tasks' character alphabet
    "moe-0.4b": ModelConfig(vocab_size=32, hidden_size=768, num_layers=12, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=128, moe_intermediate_size=448, num_experts=32,
                            top_k=4, rope_theta=10000.0, max_position_embeddings=1024),
    "qwen3-30b-a3b": ModelConfig(vocab_size=151936, hidden_size=2048, num_layers=48, num_attention_heads=32,
                                 num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
                                 top_k=8),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3's config.json; transformers' DeepseekV3Config defaults agree): 671 B,
    # MLA, 3 dense layers then 256 routed experts + 1 shared, sigmoid top-8 within 4 of 8 groups. Plan only.
    "deepseek-v3": from_hf(dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
        first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_theta=10000, rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "qwen3-235b-a22b": ModelConfig(vocab_size=151936, hidden_size=4096, num_layers=94, num_attention_heads=64,
                                   num_key_value_heads=4, head_dim=128, moe_intermediate_size=1536, num_experts=128,
                                   top_k=8),
}
