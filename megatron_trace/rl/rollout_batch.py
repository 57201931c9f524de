"""A step's rollout as the trainer sees it: the engine's samples and guidance, their prompts by
group and their rewards, with the selections dynamic sampling makes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..guidance import GuidanceBatch
from ..rollout import GroupRequest, RolloutOutput, SamplingParams
from .losses import informative_groups


@dataclass(frozen=True, kw_only=True)
class RolloutBatch:
    """A rollout with its prompts (by group id) and rewards (float [N], sample order); groups
    of `group_size` consecutive samples."""

    out: RolloutOutput
    prompts: dict[str, tuple[int, ...]]
    rewards: torch.Tensor
    group_size: int

    @property
    def num_groups(self) -> int:
        return len(self.out.samples) // self.group_size

    def select(self, groups: list[int]) -> RolloutBatch:
        """The batch of groups `groups` (indices, in that order), with their guidance."""
        idx = [g * self.group_size + i for g in groups for i in range(self.group_size)]
        samples = [self.out.samples[i] for i in idx]
        gids = {s.group_id for s in samples}
        guidance = self.out.guidance.subset(s.sample_id for s in samples)
        return RolloutBatch(out=RolloutOutput(samples, guidance),
                            prompts={k: v for k, v in self.prompts.items() if k in gids},
                            rewards=self.rewards[idx], group_size=self.group_size)

    def informative(self) -> RolloutBatch:
        """Only the groups whose rewards differ (DAPO's dynamic-sampling filter)."""
        keep = informative_groups(self.rewards, self.group_size)
        return self.select(keep.nonzero().flatten().tolist())

    def first_groups(self, n: int) -> RolloutBatch:
        """The batch of its first `n` groups (itself when it has no more)."""
        return self if self.num_groups <= n else self.select(list(range(n)))

    def merge(self, other: RolloutBatch) -> RolloutBatch:
        """Both batches' groups (group ids must differ)."""
        if set(self.prompts) & set(other.prompts):
            raise ValueError(f"rollout batches share group ids {sorted(set(self.prompts) & set(other.prompts))[:3]}")
        guidance = GuidanceBatch(self.out.guidance.groups | other.out.guidance.groups,
                                 self.out.guidance.samples | other.out.guidance.samples)
        return RolloutBatch(out=RolloutOutput(self.out.samples + other.out.samples, guidance),
                            prompts=self.prompts | other.prompts, rewards=torch.cat([self.rewards, other.rewards]),
                            group_size=self.group_size)


def rollout(engine, prompts, reward_fn, group_size: int, sampling: SamplingParams, step: int,
            tag: str = "") -> RolloutBatch:
    """`group_size` samples of each prompt, rewarded by reward_fn(prompt_ids, response_ids) -> float.
    Group ids are "s<step><tag>-p<i>", so the rounds of one step do not collide. A failed sample
    is an error naming it (the RL step cannot train on a partial group)."""
    requests = [GroupRequest(f"s{step}{tag}-p{i}", tuple(p), group_size) for i, p in enumerate(prompts)]
    out = engine.generate(requests, sampling)
    failed = [s.error for s in out.samples if s.error]
    if failed:
        raise ValueError(f"rollout failed: {failed[0]}")
    by_group = {r.group_id: r.prompt_ids for r in requests}
    rewards = torch.tensor([float(reward_fn(by_group[s.group_id], s.tokens)) for s in out.samples])
    return RolloutBatch(out=out, prompts=by_group, rewards=rewards, group_size=group_size)
