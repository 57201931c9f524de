"""The engine's weights: FP4 linears held packed (codes + scales), the rest in BF16.

Keys are the full Megatron names (megatron/weights.py). In fp4 precision every FP4-site weight
(QKV, output projection, experts' fc1/fc2) is a tensor-scaled NVFP4 `QTensor`, as checkpoints
and the trainer's weight sync carry it; it is dequantized only inside a matmul. Storage is
allocated once: a layer's experts live in stacked buffers ([E, N, K/2] codes, [E, N, K/16]
scales, [E] global scales; or [E, N, K] BF16) for grouped GEMMs, each expert's entry a view,
and updates are copied in place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_trace.model_config import (
    FP4_WEIGHT_SUFFIXES,
    ModelConfig,
    fp4_weight_peers,
    full_weight_shapes,
)
from megatron_trace.weight_buckets import NVFP4, Piece, parts_of_whole, write_piece
from trace_kernels.fp4 import Format, QTensor, dequantize, quantize

FP4_SUFFIXES = FP4_WEIGHT_SUFFIXES
ROUTER_SUFFIX = "mlp.router.weight"


class EngineWeights:
    """Name -> BF16 tensor or packed FP4 QTensor, checked against the model's shapes."""

    def __init__(self, model_cfg: ModelConfig, fp4: bool, device: str):
        self.model_cfg, self.fp4, self.device = model_cfg, fp4, torch.device(device)
        self.shapes = full_weight_shapes(model_cfg)
        self.tensors: dict[str, torch.Tensor | QTensor] = {}
        self.stacked: dict[tuple[int, str], torch.Tensor | StackedFP4] = {}  # (layer, "fc1"/"fc2") -> all experts
        # BF16 weights at FP4 sites that share a global scale with weights not yet arrived (fp4_weight_peers)
        self._pending: dict[str, torch.Tensor] = {}
        for L in model_cfg.moe_layers:
            for site, linear in (("fc1", "linear_fc1.weight"), ("fc2", "linear_fc2.weight")):
                names = [f"decoder.layers.{L}.mlp.experts.local_experts.{e}.{linear}"
                         for e in range(model_cfg.num_experts)]
                stack = self._empty((model_cfg.num_experts, *self.shapes[names[0]]), self.is_fp4(names[0]))
                self.stacked[(L, site)] = stack
                for e, name in enumerate(names):
                    self.tensors[name] = _index(stack, e)
        for name, shape in self.shapes.items():
            if name not in self.tensors:
                self.tensors[name] = self._empty(shape, self.is_fp4(name))
            if name.endswith(ROUTER_SUFFIX):  # used in FP32: held so, not cast every step
                self.tensors[name] = self.tensors[name].float()

    def _empty(self, shape: tuple[int, ...], fp4: bool) -> torch.Tensor | QTensor | StackedFP4:
        dev = self.device
        if fp4:
            lead, k = shape[:-1], shape[-1]
            codes = torch.zeros(*lead, k // 2, dtype=torch.uint8, device=dev)
            scales = torch.ones(*lead, k // 16, dtype=torch.float8_e4m3fn, device=dev)
            g = torch.ones(shape[:-2], dtype=torch.float32, device=dev)
            if len(shape) == 3:
                return StackedFP4(codes, scales, g)
            return QTensor(codes, scales, g, Format.NVFP4, torch.Size(shape))
        return torch.zeros(shape, dtype=torch.bfloat16 if len(shape) >= 2 else torch.float32, device=dev)

    def is_fp4(self, name: str) -> bool:
        """True when the weight `name` is held packed in FP4."""
        return self.fp4 and name.endswith(FP4_SUFFIXES)

    def load(self, state_dict: dict[str, torch.Tensor | QTensor]) -> None:
        """Take a complete state dict (BF16 tensors; FP4 sites may come packed as QTensors).

        Everything is checked before anything changes; then each weight is written into the
        engine's existing storage (in place, so an update needs no second copy of the model).

        Raises:
            ValueError: missing or unknown names, wrong shapes, or a QTensor where the engine
                does not hold FP4 (nothing is loaded then).
        """
        missing = sorted(set(self.shapes) - set(state_dict))
        unknown = sorted(set(state_dict) - set(self.shapes))
        if missing or unknown:
            raise ValueError(f"weight update does not fit the model: missing {missing[:5]}"
                             f"{'...' if len(missing) > 5 else ''}, unknown {unknown[:5]}")
        for name, t in state_dict.items():
            if tuple(t.shape) != self.shapes[name]:
                raise ValueError(f"weight {name} has shape {tuple(t.shape)}, the model needs {self.shapes[name]}")
            if isinstance(t, QTensor) and (not self.is_fp4(name) or t.is_row_scaled or t.fmt.value != "nvfp4"):
                raise ValueError(f"weight {name} arrived as FP4, which this engine does not hold there")
        for name, t in state_dict.items():
            self.write(Piece.whole(name, t), parts_of_whole(t))

    def write(self, piece: Piece, parts: list[torch.Tensor]) -> None:
        """Write one piece (a weight, or a slice of it; weight_buckets' format, checked by its
        `Coverage`) into the engine's storage in place. A whole BF16 weight at an FP4 site is
        quantized here, with the global scale over its peers (`fp4_weight_peers`: held back
        until they have all arrived); plain values take BF16 (2-D weights; the router held in
        FP32 keeps exactly those values) or FP32 (norms, expert biases)."""
        held = self.tensors[piece.name]
        if isinstance(held, QTensor) and piece.kind != NVFP4:
            if peers := fp4_weight_peers(piece.name, self.model_cfg):
                self._pending[piece.name] = parts[0].to(self.device)
                if all(p in self._pending for p in peers):
                    whole = [self._pending.pop(p) for p in peers]
                    amax = torch.stack([w.abs().amax().float() for w in whole]).amax()
                    for p, w in zip(peers, whole, strict=True):
                        q = quantize(w, "nvfp4", global_amax=amax)
                        write_piece(self.tensors[p], Piece.whole(p, q), parts_of_whole(q))
                return
            piece, parts = dataclasses.replace(piece, kind=NVFP4), parts_of_whole(quantize(parts[0].to(self.device),
                                                                                          "nvfp4"))
        elif not isinstance(held, QTensor):
            parts = [parts[0].to(self.device, torch.bfloat16 if len(piece.full_shape) == 2 else torch.float32)]
        write_piece(held, piece, parts)

    def dense(self, name: str) -> torch.Tensor:
        """BF16 values of a weight (FP4 weights dequantized for the matmul; the router's BF16
        values in FP32)."""
        t = self.tensors[name]
        return dequantize(t, torch.bfloat16) if isinstance(t, QTensor) else t



@dataclass(frozen=True)
class StackedFP4:
    """The FP4 weights of a layer's experts: codes uint8 [E, N, K/2], scales e4m3 [E, N, K/16],
    one global scale per expert g float32 [E]."""

    codes: torch.Tensor
    scales: torch.Tensor
    g: torch.Tensor


def _index(t: torch.Tensor | StackedFP4, e: int) -> torch.Tensor | QTensor:
    """Expert e of a stacked weight, as a view."""
    if isinstance(t, torch.Tensor):
        return t[e]
    n, half_k = t.codes.shape[1:]
    return QTensor(t.codes[e], t.scales[e], t.g[e], Format.NVFP4, torch.Size((n, 2 * half_k)))
