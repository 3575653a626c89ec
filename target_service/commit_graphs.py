"""CUDA graphs of the target's commit, one per batch size.

A commit is a handful of small launches (gathers, the conv window, one recurrence replay),
but eagerly they cost more host time than GPU time: on an H100 (2026-12-05, int4 MLPs,
Qwen3.5-4B shapes) a batch-1 commit took 0.73 ms of a 4.62 ms verify-and-commit, 1.14 ms of
8.42 at batch 8, while the verify graph's replay was 3.82 / 7.12 ms. Replayed from a graph,
the step's host work is one small copy and one launch. The graph's input is one int64
buffer [2, B]: the slots, then the kept counts (`commit_on_device`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dflash_serve.cuda_graphs import StepGraphs
from target_service.model.commit import commit_on_device
from target_service.model.state import TargetState


class CommitGraphs:
    """Captured commits of 1..B slots; `has(batch_size)` says which batch sizes replay."""

    def __init__(
        self, state: TargetState, recurrence_kernel: Callable, batch_sizes: tuple[int, ...]
    ) -> None:
        """Captures immediately; must run before any sequence holds state (capturing commits
        slots 0..B-1, whose state opening a sequence resets)."""
        self.state = state
        self.recurrence_kernel = recurrence_kernel
        device = state.recurrent_state.device
        warmup = {}
        for batch_size in batch_sizes:
            inputs = torch.ones((2, batch_size), dtype=torch.int64, device=device)
            inputs[0] = torch.arange(batch_size, device=device)
            warmup[batch_size] = (inputs,)
        self.graphs = StepGraphs(self._commit, warmup)

    def _commit(self, inputs: tuple[torch.Tensor], batch_size: int) -> tuple[()]:
        (inputs,) = inputs
        commit_on_device(self.state, inputs[0], inputs[1], self.recurrence_kernel)
        return ()

    def has(self, batch_size: int) -> bool:
        return self.graphs.has(batch_size)

    def replay(self, slots: Sequence[int], num_kept: Sequence[int]) -> None:
        """The GDN state changes of committing num_kept[i] tokens of each slot's block
        (checked by the caller); the host's bookkeeping is `record_commits`."""
        self.graphs.replay(len(slots), torch.tensor([list(slots), list(num_kept)]))
