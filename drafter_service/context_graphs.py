"""CUDA graphs of adding many context rows in one forward: the prompts of first drafts.

A request's first draft brings its prompt's features; the rows beyond the draft graph's
block are added first, every slot of the batch in one forward (`DFlashDrafter.add_contexts`:
rows packed [N, 1, taps·hidden], each with its own slot id and position). Run eagerly that
forward is ~50 launches whose host time the GPU waits for: on an H100, 1.1 ms for one
prompt's 112 rows and 1.5 ms for eight, against ~0.3 ms of GPU work for the eight
(`bench/results/first-draft-2026-12-07-nvidia-h100.json`), and more on a service whose event
loop shares the interpreter. A graph replays them in one launch, but has one row count, so
rows are padded to the smallest captured count that holds them. Padding rows go to the last
cache row of slot 0: past `max_len`, where only a draft block's scratch keys ever sit, written
by the draft forward that reads them (`DrafterContextCache`); so they are never attended.
"""

from __future__ import annotations

import torch

from dflash_serve.cuda_graphs import StepGraphs
from drafter_service.model.context_cache import DrafterContextCache
from drafter_service.model.dflash import DFlashDrafter, packed_row_ids

CONTEXT_ROW_COUNTS = (128, 256, 512, 1024, 2048)


class ContextGraphs:
    """Captured `add_context_on_device` forwards of packed rows, one per row count; their
    features are views of one buffer (replays are serial)."""

    def __init__(
        self,
        model: DFlashDrafter,
        cache: DrafterContextCache,
        max_rows: int,
        row_counts: tuple[int, ...] = CONTEXT_ROW_COUNTS,
    ) -> None:
        """Captures immediately (a forward of each row count), on a model already on its GPU
        kernels; the captures write only the padding row (the last of slot 0), so slots may
        already hold context. Counts beyond the first that holds `max_rows` (no batch brings
        more) are left out: the largest count's features buffer stays allocated (52 MB at
        2048 rows of the 4B pair's 5 × 2560 features)."""
        self.model = model
        self.cache = cache
        counts = sorted(row_counts)
        needed = next((i for i, count in enumerate(counts) if count >= max_rows), len(counts) - 1)
        self.row_counts = tuple(counts[: needed + 1])
        weight = model.fc.weight
        self.device, self.dtype = weight.device, weight.dtype
        self._padding = (0, cache.keys.shape[2] - 1)  # slot 0, the cache's last row
        features = torch.zeros(
            (self.row_counts[-1], 1, weight.shape[1]), dtype=self.dtype, device=self.device
        )
        warmup = {
            count: (self._padded_ids(count).to(self.device), features[:count])
            for count in self.row_counts
        }
        self.graphs = StepGraphs(self._add, warmup)

    def _add(self, inputs, row_count: int) -> tuple[()]:
        ids, features = inputs
        self.model.add_context_on_device(self.cache, ids[0], ids[1], features)
        return ()

    @torch.inference_mode()
    def add(self, slots: list[int], features: list[torch.Tensor]) -> bool:
        """`DFlashDrafter.add_contexts(cache, slots, features)` through the graph of the
        smallest row count that holds all the rows; False (nothing done) if none does."""
        counts = [rows.shape[0] for rows in features]
        total = sum(counts)
        if not total:
            return True
        row_count = next((n for n in self.row_counts if n >= total), None)
        if row_count is None:
            return False
        ids_buffer, features_buffer = self.graphs.input_buffers(row_count)
        parts = [rows.to(self.device, self.dtype) for rows in features]
        torch.cat(parts, out=features_buffer[:total, 0])
        ids = self._padded_ids(row_count)
        ids[:, :total] = packed_row_ids(self.cache, slots, counts)
        ids_buffer.copy_(ids)
        self.graphs.replay_as_filled(row_count)
        for slot, count in zip(slots, counts, strict=True):
            self.cache.lengths[slot] += count
        return True

    def _padded_ids(self, row_count: int) -> torch.Tensor:
        """[2, row_count] slot ids and positions on the host, every row the padding row."""
        return torch.tensor(self._padding).unsqueeze(1).repeat(1, row_count)
