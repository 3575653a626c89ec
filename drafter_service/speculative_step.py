"""The drafter's half of a speculative step: ingest committed features, then draft.

Requests of many sessions with the same draft length share one forward.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_serve.errors import DflashError
from drafter_service.engine import DrafterEngine


@dataclass(frozen=True)
class Drafts:
    token_ids: list[int]
    forward_ns: int  # the batched forward's time
    batch_size: int  # sessions that shared it


@dataclass(frozen=True)
class DraftRequest:
    slot: int
    features: torch.Tensor  # [n, taps·hidden] of the tokens committed since the last draft
    anchor_id: int
    num_drafts: int


def add_context_and_draft(
    engine: DrafterEngine, requests: Sequence[DraftRequest]
) -> list[Drafts | DflashError]:
    """One result per request, in order; an invalid request gets its error, others run.

    Requests drafting the same number of tokens add their context and draft together (one
    CUDA graph on the GPU fast path); a group that fails changes nothing.
    """
    began_ns = time.perf_counter_ns()  # context ingestion counts as forward time
    results: list[Drafts | DflashError | None] = [None] * len(requests)
    groups: dict[int, list[int]] = defaultdict(list)
    for index, request in enumerate(requests):
        try:
            engine.check_context(request.slot, request.features, request.num_drafts)
            if request.num_drafts == 0:  # a paced-out step: its context joins the next draft
                engine.defer_context(request.slot, request.features)
                results[index] = Drafts([], time.perf_counter_ns() - began_ns, 1)
                continue
        except DflashError as error:
            results[index] = error
            continue
        groups[request.num_drafts].append(index)
    for num_drafts, indices in groups.items():
        group = [requests[i] for i in indices]
        try:
            proposals = engine.add_context_and_draft(
                [r.slot for r in group],
                [r.features for r in group],
                [r.anchor_id for r in group],
                num_drafts,
            )
        except DflashError as error:
            for index in indices:
                results[index] = error
            continue
        elapsed_ns = time.perf_counter_ns() - began_ns
        for index, proposal in zip(indices, proposals, strict=True):
            results[index] = Drafts(proposal, elapsed_ns, len(indices))
    return results
