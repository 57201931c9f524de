"""The guidance of a rollout batch: per sample, per layer, per site; prompts once per group.

A GRPO group's G samples share their prompt, so the prompt rows of every site are stored
once in the group (`GroupGuidance`) and each sample holds only its response rows. A trainer
rank applies a sample's guidance with `guided_inputs`, which splits its rows at the prompt
length and checks every record against the sample, layer, site and weight version.

Wire format (`to_bytes`): magic, u64 header length, a JSON header (format version, record
headers, tensor manifest, CRC-32 of the payload), then the payload tensors' bytes in
manifest order. `to_tensors` gives the same as three uint8/int64 tensors for NCCL.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from .capture import guided_inputs as record_guided_inputs
from .codec import GuidanceFormatError
from .record import FORMAT_VERSION, GuidanceRecord, RecordHeader

MAGIC = b"TRACEGD\x01"
SiteKey = tuple[int, str]  # (layer, site)


def expert_id_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds expert ids 0..num_experts-1: routed experts travel
    from the engine to the trainer in it (uint8 up to 256 experts, int16 up to 32768); the
    trainer widens them where it indexes with them (`MicroBatchGuidance.from_batch`)."""
    return torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2**15 else torch.int32


def _check_experts(experts: dict[int, torch.Tensor], tokens: int, owner: str) -> None:
    for layer, ids in experts.items():
        if ids.dim() != 2 or ids.shape[0] != tokens or ids.dtype.is_floating_point:
            raise GuidanceFormatError(f"routed experts of layer {layer} for the {owner} must be integer "
                                      f"[{tokens}, top_k], got {ids.dtype} {tuple(ids.shape)}")


@dataclass(kw_only=True)
class GroupGuidance:
    """A GRPO group's prompt: its length, per-site prompt records and routed experts."""

    group_id: str
    prompt_len: int
    records: dict[SiteKey, GuidanceRecord] = field(default_factory=dict)
    # layer -> [prompt_len, top_k] expert ids, in expert_id_dtype as the engines send them
    routed_experts: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(kw_only=True)
class SampleGuidance:
    """One sample's response guidance and routed experts; its prompt lives in its group."""

    sample_id: str
    group_id: str
    response_len: int
    weight_version: int
    records: dict[SiteKey, GuidanceRecord] = field(default_factory=dict)
    routed_experts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [response_len, top_k] (ditto)


@dataclass
class GuidanceBatch:
    groups: dict[str, GroupGuidance] = field(default_factory=dict)
    samples: dict[str, SampleGuidance] = field(default_factory=dict)

    def add_group(self, group: GroupGuidance) -> None:
        """Add a group's prompt guidance; GuidanceFormatError for a repeated group or experts not covering the
        prompt."""
        if group.group_id in self.groups:
            raise GuidanceFormatError(f"group {group.group_id!r} is already in the batch")
        _check_experts(group.routed_experts, group.prompt_len, f"group {group.group_id!r} prompt")
        self.groups[group.group_id] = group

    def add_sample(self, sample: SampleGuidance) -> None:
        """Add a sample's response guidance; GuidanceFormatError for an unknown group, a repeat, or experts not
        covering the response."""
        if sample.group_id not in self.groups:
            raise GuidanceFormatError(f"sample {sample.sample_id!r} names unknown group {sample.group_id!r}")
        if sample.sample_id in self.samples:
            raise GuidanceFormatError(f"sample {sample.sample_id!r} is already in the batch")
        _check_experts(sample.routed_experts, sample.response_len, f"sample {sample.sample_id!r} response")
        self.samples[sample.sample_id] = sample

    def subset(self, sample_ids) -> GuidanceBatch:
        """The guidance of these samples and of their groups' prompts only."""
        samples = {sid: self.samples[sid] for sid in sample_ids if sid in self.samples}
        groups = {s.group_id for s in samples.values()}
        return GuidanceBatch({k: v for k, v in self.groups.items() if k in groups}, samples)

    # -- applying -------------------------------------------------------------------------
    def guided_inputs(self, sample_id: str, layer: int, site: str, x_RK: torch.Tensor, rows_per_token: int = 1,
                      weight_version: int | None = None):
        """(g, block scales, mantissa bits) for a sample's rows of one site, prompt then response.

        Args:
            x_RK: the trainer's rows for the whole sample [(prompt_len + response_len) * rows_per_token, K]
                (rows_per_token is top_k for `fc2`, KV heads for `k`/`v`).
            weight_version: the trainer's expected version; defaults to the sample's.
        Raises:
            GuidanceFormatError: unknown sample or site, or any record that does not fit.
        """
        sample = self.samples.get(sample_id)
        if sample is None:
            raise GuidanceFormatError(f"no guidance for sample {sample_id!r} in this batch")
        group = self.groups[sample.group_id]
        version = sample.weight_version if weight_version is None else weight_version
        n_prompt = group.prompt_len * rows_per_token
        n_total = (group.prompt_len + sample.response_len) * rows_per_token
        if x_RK.shape[0] != n_total:
            raise GuidanceFormatError(f"sample {sample_id!r} has {n_total} rows for site {site} "
                                      f"(prompt {group.prompt_len} + response {sample.response_len} tokens "
                                      f"x {rows_per_token}), got {x_RK.shape[0]}")
        parts = []
        for rec, rows, owner in ((group.records.get((layer, site)), x_RK[:n_prompt], group.group_id),
                                 (sample.records.get((layer, site)), x_RK[n_prompt:], sample.sample_id)):
            if rec is None:
                raise GuidanceFormatError(f"no guidance for layer {layer} site {site} in {owner!r}")
            parts.append(record_guided_inputs(rec, rows, sample_id=owner, weight_version=version, layer=layer,
                                              site=site))
        return tuple(torch.cat(ts) for ts in zip(*parts, strict=True))

    # -- accounting -----------------------------------------------------------------------
    def _records(self):
        for group in self.groups.values():
            yield from group.records.values()
        for sample in self.samples.values():
            yield from sample.records.values()

    def _expert_tensors(self):
        for owner in (*self.groups.values(), *self.samples.values()):
            yield from owner.routed_experts.values()

    @property
    def nbytes(self) -> int:
        """Payload bytes: guidance records plus routed experts (prompts counted once per group)."""
        return (sum(r.nbytes for r in self._records())
                + sum(t.numel() * t.element_size() for t in self._expert_tensors()))

    @property
    def guidance_nbytes(self) -> int:
        """Bytes of the records alone (routed experts excluded)."""
        return sum(r.nbytes for r in self._records())

    @property
    def num_tokens(self) -> int:
        """Tokens the trainer processes: every sample's prompt and response."""
        return sum(self.groups[s.group_id].prompt_len + s.response_len for s in self.samples.values())

    def bytes_per_token(self) -> float:
        """All bytes (records and routed experts) per token of the batch."""
        return self.nbytes / max(1, self.num_tokens)

    # -- serialisation --------------------------------------------------------------------
    def _entries(self):
        """(owner kind, owner id, key, tensor) in a fixed order, for the wire format."""
        for kind, owners in (("group", self.groups), ("sample", self.samples)):
            for oid, owner in owners.items():
                for (layer, site), rec in sorted(owner.records.items()):
                    for name, t in rec.payload.items():
                        yield kind, oid, f"rec/{layer}/{site}/{name}", t
                for layer, t in sorted(owner.routed_experts.items()):
                    yield kind, oid, f"experts/{layer}", t

    def _header(self, manifest, crc) -> dict:
        def owner_meta(o):
            meta = {k: v for k, v in vars(o).items() if k not in ("records", "routed_experts")}
            meta["records"] = [r.header.to_dict() for _, r in sorted(o.records.items())]
            return meta
        return {"format_version": FORMAT_VERSION, "crc32": crc, "manifest": manifest,
                "groups": [owner_meta(g) for g in self.groups.values()],
                "samples": [owner_meta(s) for s in self.samples.values()]}

    def to_tensors(self) -> list[torch.Tensor]:
        """[sizes int64 [2], header uint8 [H], payload uint8 [P]] (CPU), for NCCL or gloo."""
        manifest, blobs, crc = [], [], 0
        for kind, oid, key, t in self._entries():
            raw = t.detach().contiguous().cpu().view(torch.uint8).reshape(-1)
            manifest.append([kind, oid, key, str(t.dtype).removeprefix("torch."), list(t.shape), raw.numel()])
            crc = zlib.crc32(raw.numpy().tobytes(), crc)
            blobs.append(raw)
        header = torch.from_numpy(np.frombuffer(json.dumps(self._header(manifest, crc)).encode(),
                                                dtype=np.uint8).copy())
        payload = torch.cat(blobs) if blobs else torch.empty(0, dtype=torch.uint8)
        return [torch.tensor([header.numel(), payload.numel()], dtype=torch.int64), header, payload]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor]) -> GuidanceBatch:
        """The batch `to_tensors` sent (sizes, header, payload uint8 tensors); checks version and CRC."""
        if len(tensors) != 3:
            raise GuidanceFormatError(f"a guidance batch travels as 3 tensors, got {len(tensors)}")
        sizes, header, payload = (t.cpu() for t in tensors)
        if [header.numel(), payload.numel()] != sizes.tolist():
            raise GuidanceFormatError(f"guidance tensors are truncated: sizes say {sizes.tolist()}, "
                                      f"got {[header.numel(), payload.numel()]}")
        try:
            meta = json.loads(bytes(header.numpy().tobytes()).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise GuidanceFormatError(f"guidance header is corrupted: {e}") from None
        return cls._from_parts(meta, payload.numpy().tobytes())

    def to_bytes(self) -> bytes:
        """The batch as one byte string (magic, sizes, JSON header, payload), for spilling to disk."""
        _, header, payload = self.to_tensors()
        return (MAGIC + struct.pack("<QQ", header.numel(), payload.numel()) + header.numpy().tobytes()
                + payload.numpy().tobytes())

    @classmethod
    def from_bytes(cls, data: bytes) -> GuidanceBatch:
        """The batch `to_bytes` wrote; GuidanceFormatError for a truncated, corrupted or unknown stream."""
        if data[:len(MAGIC)] != MAGIC:
            raise GuidanceFormatError("not a TRACE guidance stream (bad magic) or an unknown container version")
        off = len(MAGIC) + 16
        if len(data) < off:
            raise GuidanceFormatError("guidance stream is truncated inside its preamble")
        h_len, p_len = struct.unpack("<QQ", data[len(MAGIC):off])
        if len(data) != off + h_len + p_len:
            raise GuidanceFormatError(f"guidance stream has {len(data)} bytes, its preamble says "
                                      f"{off + h_len + p_len} (truncated or padded)")
        sizes = torch.tensor([h_len, p_len], dtype=torch.int64)
        header = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, count=h_len, offset=off).copy())
        payload = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=off + h_len).copy())
        return cls.from_tensors([sizes, header, payload])

    @classmethod
    def _from_parts(cls, meta: dict, payload: bytes) -> GuidanceBatch:
        if meta.get("format_version") != FORMAT_VERSION:
            raise GuidanceFormatError(f"guidance format version {meta.get('format_version')!r} is not supported "
                                      f"(this build reads {FORMAT_VERSION})")
        if zlib.crc32(payload) != meta["crc32"]:
            raise GuidanceFormatError("guidance payload checksum mismatch: the stream is corrupted")
        tensors, off = {}, 0
        for kind, oid, key, dtype, shape, n in meta["manifest"]:
            raw = np.frombuffer(payload, dtype=np.uint8, count=n, offset=off).copy()
            tensors[(kind, oid, key)] = torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
            off += n
        if off != len(payload):
            raise GuidanceFormatError(f"guidance payload has {len(payload) - off} bytes the manifest does not name")

        def rebuild(kind, m, owner_cls):
            records = {}
            for hd in m["records"]:
                h = RecordHeader.from_dict(hd)
                prefix = f"rec/{h.layer}/{h.site}/"
                payload_t = {k[2][len(prefix):]: t for k, t in tensors.items()
                             if k[0] == kind and k[1] == m[id_key[kind]] and k[2].startswith(prefix)}
                records[(h.layer, h.site)] = GuidanceRecord(h, payload_t)
            experts = {int(k[2].split("/")[1]): t for k, t in tensors.items()
                       if k[0] == kind and k[1] == m[id_key[kind]] and k[2].startswith("experts/")}
            fields = {k: v for k, v in m.items() if k != "records"}
            return owner_cls(**fields, records=records, routed_experts=experts)

        id_key = {"group": "group_id", "sample": "sample_id"}
        batch = cls()
        for m in meta["groups"]:
            batch.add_group(rebuild("group", m, GroupGuidance))
        for m in meta["samples"]:
            batch.add_sample(rebuild("sample", m, SampleGuidance))
        return batch
