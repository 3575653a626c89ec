"""CUDA graphs of a step function, one per static shape, replayed with new inputs.

A decode-time step (the target's verify, the drafter's draft) is hundreds of small kernel
launches; replaying them as one graph removes the Python and launch cost. The step reads
everything that varies between calls from its input tensors (slots, positions, token ids,
features) and returns tensors; `replay` copies new inputs into the captured buffers, replays,
and returns copies of the outputs (the captured outputs are overwritten by the next replay).
A caller that fills part of an input buffer itself (rows padded to the captured count) writes
into `input_buffers` and calls `replay_as_filled`.
Shapes that were not captured return None, and the caller runs the same step eagerly.

Python's cyclic garbage collector must not run during a capture: it can free an earlier,
dropped set of graphs (they sit in reference cycles through their step's bound method), and
destroying a graph or releasing its memory pool in the middle of a capture invalidates the
capture ("operation failed due to a previous error during capture"; seen on the H200 when a
second engine was built after a first was dropped). torch no longer collects before a capture
(only under `force_cudagraph_gc`), so `StepGraphs` collects once first, then pauses the
collector for each capture. The collector's switch is process-wide, so captures take one
process-wide lock: a second thread's capture cannot re-enable it during the first.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)
_CAPTURE_LOCK = threading.Lock()

Inputs = tuple[torch.Tensor, ...]
StepFn = Callable[[Inputs, Hashable], tuple[torch.Tensor | None, ...]]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: Inputs
    outputs: tuple[torch.Tensor | None, ...]


class StepGraphs:
    """Captured graphs of `step(inputs, key)`; all share one memory pool (replays are serial)."""

    def __init__(self, step: StepFn, warmup_inputs: dict[Hashable, Inputs]) -> None:
        """warmup_inputs: per key, inputs (on the GPU) valid for one eager run; the graph
        keeps their shape. Capturing runs the step (twice) with them."""
        self.step = step
        self.pool = torch.cuda.graph_pool_handle()
        gc.collect()  # what is already garbage goes now, outside any capture
        self.captured = {key: self._capture(key, inputs) for key, inputs in warmup_inputs.items()}
        logger.info("captured %d graphs: %s", len(self.captured), list(self.captured))

    @torch.inference_mode()
    def _capture(self, key: Hashable, inputs: Inputs) -> _Captured:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile kernels and settle the allocator first
            self.step(inputs, key)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with _CAPTURE_LOCK, _collector_paused(), torch.cuda.graph(graph, pool=self.pool):
            outputs = self.step(inputs, key)
        return _Captured(graph, inputs, outputs)

    def has(self, key: Hashable) -> bool:
        return key in self.captured

    def replay(self, key: Hashable, *new_inputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Outputs of the step for these inputs (shapes as at capture, on any device), as
        copies."""
        captured = self.captured[key]
        for buffer, new in zip(captured.inputs, new_inputs, strict=True):
            buffer.copy_(new, non_blocking=True)
        captured.graph.replay()
        return tuple(None if out is None else out.clone() for out in captured.outputs)

    def input_buffers(self, key: Hashable) -> Inputs:
        """The captured graph's own input tensors, for a caller that writes its inputs in
        place (part of a buffer, say) and then calls `replay_as_filled`."""
        return self.captured[key].inputs

    def replay_as_filled(self, key: Hashable) -> None:
        """Replay on what `input_buffers(key)` hold now, for a step run for its side effects
        (its outputs are left in the graph's buffers, not copied)."""
        self.captured[key].graph.replay()


@contextlib.contextmanager
def _collector_paused():
    """No automatic garbage collection inside (an explicit gc.collect() still runs)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
