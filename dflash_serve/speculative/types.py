"""Plain data that crosses between the loop and the sessions (no torch, no protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_serve.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How the target picks its token. temperature 0 is greedy; otherwise the token at
    absolute position p is drawn with randomness keyed by (seed, p), so the same request
    gives the same text whatever the drafter proposes."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not self.temperature >= 0.0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in 0..2^63-1, got {self.seed}")


@dataclass(frozen=True)
class TargetStep:
    """What the target returns for a prefill or a verify.

    token_ids: the tokens this step produced (the accepted drafts, then the target's own
    token); the last one is the next anchor, not yet fed to the target. features: the
    tapped hidden states of the tokens the target committed in this step, opaque to the
    loop (a tensor in-process, a reference over gRPC); start_position: the absolute position
    of the first of those tokens; forward_ns / batch_size: the batched forward's time and
    how many sessions shared it.
    """

    token_ids: list[int]
    num_accepted: int
    features: Any
    start_position: int = 0
    forward_ns: int = 0
    batch_size: int = 1


@dataclass
class SpecStats:
    """Per-request counters, in vLLM's spec-decode terms."""

    num_drafts: int = 0  # verify steps that carried at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_target_steps: int = 0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_target_steps += 1
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            grow = num_drafted - len(self.accepted_per_position)
            self.accepted_per_position.extend([0] * grow)
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """τ: 1 + accepted / drafts (vLLM's definition); 1.0 with no drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
