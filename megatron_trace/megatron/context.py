"""Which guidance the FP4 sites of the model see during a forward (and its recomputation).

The training step hands the model one `MicroBatchGuidance` per micro-batch: for each guided
(layer, site) the rows of the whole micro-batch in its token order ([S, B] flattened with S
outermost, so a packed batch is simply its tokens in order), and the engine's routed experts
per MoE layer. Each site takes the rows it processes (its sequence-parallel shard, its
tensor-parallel heads or columns, the tokens the expert dispatcher brought to its experts).

Activation follows autograd, not program order: pipeline schedules interleave the forward of
one micro-batch with the backward of another, and activation recomputation re-runs a layer
during backward. The model activates its micro-batch's guidance when its forward starts and
again when its backward starts (`ActivateOnBackward` sits on the model's output), so a
recomputed layer sees the same guidance as the first run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from trace_kernels.host_copy import HostCopy

from ..guidance.batch import GuidanceBatch
from ..guidance.codec import GuidanceFormatError
from ..guidance.record import SITES, GuidanceRecord
from ..guidance.rows import RowGuidance


@dataclass
class MicroBatchGuidance:
    """Guidance of one micro-batch of `num_tokens` tokens.

    sites: (layer, site) -> RowGuidance with num_tokens * rows_per_token rows, layer 0-based;
        rows per token: 1 for qkv, proj, fc1; top_k for fc2 ((token, slot) order, slots in
        the engine's routed-expert order); KV heads for k and v ((token, head) order).
    routed_experts: layer -> int64 [num_tokens, top_k], the engine's expert choices, replayed
        by the trainer's routers.
    """

    num_tokens: int
    sites: dict[tuple[int, str], RowGuidance] = field(default_factory=dict)
    routed_experts: dict[int, torch.Tensor] = field(default_factory=dict)
    # set during the MoE forward: layer -> (fc2 rows of the dispatched tokens, rows per local expert
    # as a list, or an int64 tensor until a per-expert site asks: `expert_counts`)
    expert_rows: dict[int, tuple[RowGuidance, list[int] | torch.Tensor]] = field(default_factory=dict)
    # checks the forward defers to its end (`defer_check`): (layer, what failed) -> bool tensor, True = passed
    pending_checks: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # routed experts clamped into range for indexing, while their check is pending (`check_routed_experts`)
    indexable_experts: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for layer, ids in self.routed_experts.items():
            if ids.dim() != 2 or ids.shape[0] != self.num_tokens or ids.dtype.is_floating_point:
                raise GuidanceFormatError(f"routed experts of layer {layer} must be integer "
                                          f"[{self.num_tokens}, top_k], got {ids.dtype} {tuple(ids.shape)}")
        for (layer, site), rg in self.sites.items():
            if site not in SITES:
                raise GuidanceFormatError(f"unknown FP4 site {site!r} (layer {layer}); sites are {list(SITES)}")
            if rg.num_rows % self.num_tokens:
                raise GuidanceFormatError(f"layer {layer} site {site}: {rg.num_rows} guidance rows do not divide "
                                          f"into {self.num_tokens} tokens")

    def site(self, layer: int, site: str) -> RowGuidance | None:
        return self.sites.get((layer, site))

    def expert_counts(self, layer: int) -> list[int]:
        """Rows per local expert of the fc2 rows dispatched at `layer` (on the host; a device
        count is copied once, when the first per-expert site asks)."""
        rows, counts = self.expert_rows[layer]
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()
            self.expert_rows[layer] = (rows, counts)
        return counts

    def check_routed_experts(self, num_experts: int) -> None:
        """Check each layer's routed expert ids (within 0..num_experts-1, none repeated within a
        token) without a host synchronisation: the checks are deferred (`defer_check`: read at the
        forward's end, or at `checks_read_at_end`'s), and the layers index with `routed_ids`, the
        ids clamped into range, so that a bad id cannot index out of bounds before its error is
        raised. Its error comes before any optimizer step, so nothing computed from it is applied.
        A sync here would drain the GPU's queue once a micro-batch."""
        self.indexable_experts = {}
        for layer, ids in sorted(self.routed_experts.items()):
            if not ids.numel():
                continue
            ordered = ids.sort(dim=1).values
            self.defer_check(layer, f"routed expert ids outside 0..{num_experts - 1}",
                             ((ids >= 0) & (ids < num_experts)).all())
            self.defer_check(layer, "routed expert ids repeat within their token",
                             (ordered[:, 1:] != ordered[:, :-1]).all())
            self.indexable_experts[layer] = ids.clamp(0, num_experts - 1)

    def routed_ids(self, layer: int) -> torch.Tensor | None:
        """The engine's routed experts of `layer` [num_tokens, top_k] to index with (clamped into
        range while `check_routed_experts`' check is pending), or None."""
        return self.indexable_experts.get(layer, self.routed_experts.get(layer))

    def raise_failed_checks(self) -> None:
        """Read this forward's pending checks now and raise if one failed: called where the forward
        failed otherwise, since a bad input behind a deferred check may be the cause (repeated
        routed ids break the dispatcher's split sizes), so that the cause is named first."""
        passed = [bool(t) for t in self.pending_checks.values()]
        if not all(passed):
            keys = list(self.pending_checks)
            self.pending_checks.clear()  # forgotten once raised, as by `close_checks`
            _raise_failed([f"layer {layer}: {what}" for layer, what in keys], passed)

    def defer_check(self, layer: int, what: str, passed: torch.Tensor) -> None:
        """Keep a check of this forward (a bool tensor, True when it passed) for `close_checks`,
        so that the forward needs no host synchronisation per layer."""
        self.pending_checks[(layer, what)] = passed

    def close_checks(self) -> None:
        """The end of a forward: its deferred checks are read now (one host synchronisation) or,
        inside `checks_read_at_end`, sent to the host behind an event and read at that scope's
        end; then forgotten.

        Raises:
            GuidanceFormatError: naming each layer whose check failed and what failed.
        """
        if not self.pending_checks:
            return
        keys = list(self.pending_checks)
        passed = torch.stack([t.reshape(()).to(torch.bool) for t in self.pending_checks.values()])
        self.pending_checks.clear()
        if _forward_checks is not None:
            _forward_checks.append((keys, HostCopy(passed)))
            return
        _raise_failed([f"layer {layer}: {what}" for layer, what in keys], passed.tolist())

    def to(self, device) -> MicroBatchGuidance:
        return MicroBatchGuidance(self.num_tokens, {k: v.to(device) for k, v in self.sites.items()},
                                  {k: v.to(device) for k, v in self.routed_experts.items()})

    def padded(self, extra: int, num_first: int) -> MicroBatchGuidance:
        """`extra` more tokens at the end, copying the rows and routed experts of the first
        sequence's first tokens, cyclically (the first sequence has `num_first` tokens): the
        guidance of `pack_sequences`' padding, whose activations are that prefix's (sequence
        parallelism needs token counts divisible by the tensor-parallel size)."""
        if extra == 0:
            return self
        copies = torch.arange(extra) % num_first
        sites = {}
        for key, rg in self.sites.items():
            per = rg.num_rows // self.num_tokens
            rows = (copies[:, None] * per + torch.arange(per)).reshape(-1)
            sites[key] = rg.select_rows(torch.cat([torch.arange(rg.num_rows), rows]).to(rg.g.device))
        experts = {L: torch.cat([e, e[copies.to(e.device)]]) for L, e in self.routed_experts.items()}
        return MicroBatchGuidance(self.num_tokens + extra, sites, experts)

    def for_layers(self, layers) -> MicroBatchGuidance:
        """Only the given (0-based) layers: what one pipeline stage needs. A view: the MoE
        layers' dispatched rows (and deferred checks) land in this micro-batch's too."""
        keep = set(layers)
        return MicroBatchGuidance(self.num_tokens, {k: v for k, v in self.sites.items() if k[0] in keep},
                                  {k: v for k, v in self.routed_experts.items() if k in keep}, self.expert_rows,
                                  self.pending_checks)

    @classmethod
    def from_batch(cls, batch: GuidanceBatch, sample_ids: list[str], *, layers=None,
                   weight_version: int | None = None) -> MicroBatchGuidance:
        """Concatenate samples (prompt rows, then response rows, sample after sample) in the
        order they are packed into the micro-batch.

        Args:
            sample_ids: the samples of the micro-batch, in packing order.
            layers: keep only these 0-based layers (a pipeline stage's); None keeps all.
            weight_version: the trainer's expected weight version (checked per record).
        Raises:
            GuidanceFormatError: a sample or record is missing, or does not fit.
        """
        keep = None if layers is None else set(layers)
        per_site: dict[tuple[int, str], list[GuidanceRecord]] = {}
        experts: dict[int, list[torch.Tensor]] = {}
        num_tokens = 0
        for sid in sample_ids:
            sample = batch.samples.get(sid)
            if sample is None:
                raise GuidanceFormatError(f"no guidance for sample {sid!r} in this batch")
            group = batch.groups[sample.group_id]
            version = sample.weight_version if weight_version is None else weight_version
            keys = {k for k in (*group.records, *sample.records) if keep is None or k[0] in keep}
            if num_tokens and set(per_site) != keys:
                raise GuidanceFormatError(f"sample {sid!r} guides sites {sorted(keys)}, the samples before it "
                                          f"{sorted(per_site)}: every sample of a micro-batch needs the same sites")
            for key in sorted(keys):
                for owner, rec in ((group.group_id, group.records.get(key)), (sid, sample.records.get(key))):
                    if rec is None:
                        raise GuidanceFormatError(f"no guidance for layer {key[0]} site {key[1]} in {owner!r}")
                    if rec.header.sample_id != owner or rec.header.weight_version != version:
                        raise GuidanceFormatError(
                            f"record for layer {key[0]} site {key[1]} belongs to {rec.header.sample_id!r} at weight "
                            f"version {rec.header.weight_version}, used for {owner!r} at version {version}")
                    per_site.setdefault(key, []).append(rec)
            for layer in set(group.routed_experts) | set(sample.routed_experts):
                if keep is not None and layer not in keep:
                    continue
                if layer not in group.routed_experts or layer not in sample.routed_experts:
                    raise GuidanceFormatError(f"routed experts of layer {layer} missing for prompt or response "
                                              f"of {sid!r}")
                experts.setdefault(layer, []).extend([group.routed_experts[layer], sample.routed_experts[layer]])
            num_tokens += group.prompt_len + sample.response_len
        return cls(num_tokens, {k: RowGuidance.from_records(v).with_row_ids() for k, v in per_site.items()},
                   {k: torch.cat(v).long() for k, v in experts.items()})


def expert_major_order(ids_TK: torch.Tensor) -> torch.Tensor:
    """The (token, slot) rows [T * k] of routed expert ids int [T, k], as a dispatcher of one rank
    that drops nothing orders them: by expert, tokens ascending (Megatron's `permute`)."""
    return torch.sort(ids_TK.reshape(-1), stable=True).indices


def _raise_failed(labels: list[str], passed: list[bool]) -> None:
    failed = [label for label, ok in zip(labels, passed, strict=True) if not ok]
    if failed:
        raise GuidanceFormatError("; ".join(failed))


# the forwards' checks inside `checks_read_at_end`: (keys, bool [n] on its way to the host) per
# forward, in order
_forward_checks: list[tuple[list, HostCopy]] | None = None


@contextlib.contextmanager
def checks_read_at_end():
    """Within this scope (one call's micro-batches), each forward's deferred checks are read once
    at the scope's end, with every other forward's, not at the forward's end. Reading a GPU
    tensor waits for all the work queued so far, and the GPU then idles while the host queues
    what comes next: between a forward and its backward, or, at the scope's end, before the
    optimizer step. So each forward's flags are copied to the host behind an event at its end
    (`HostCopy`), and the scope's end waits only for the last forward, long done on the GPU
    while the host queued the backward. A failed check is raised at the scope's end, naming the
    forward (the micro-batch, in the order of the forwards) and the layer, before any optimizer
    step; the gradients of that call are not to be used.

    Raises:
        GuidanceFormatError: at the end, naming each forward and layer whose check failed.
    """
    global _forward_checks
    outer, _forward_checks = _forward_checks, []
    try:
        yield
        forwards = _forward_checks
    finally:
        _forward_checks = outer
    if forwards:
        _raise_failed([f"micro-batch {i}: layer {layer}: {what}" for i, (keys, _) in enumerate(forwards)
                       for layer, what in keys], torch.cat([p.get() for _, p in forwards]).tolist())


_active: MicroBatchGuidance | None = None


def active() -> MicroBatchGuidance | None:
    """The guidance of the micro-batch being computed, or None."""
    return _active


def activate(guidance: MicroBatchGuidance | None) -> None:
    global _active
    _active = guidance


class ActivateOnBackward(torch.autograd.Function):
    """Identity on the model output whose backward re-activates the micro-batch's guidance,
    before any layer of that micro-batch is recomputed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, guidance) -> torch.Tensor:
        ctx.guidance = guidance
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        activate(ctx.guidance)
        return grad, None
