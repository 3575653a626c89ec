"""The target engine: sequence slots and the three operations the service exposes.

- `prefill(slot, prompt_ids)`: commit a prompt; return the last position's logits and the
  tapped hidden states of every prompt token (chunked, so long prompts never need
  prompt-length × vocab logits). `prefill_together` commits several sessions' short prompts
  in one forward.
- `verify(slots, block_ids)`: run 1..16 tokens per sequence without committing; return the
  logits and taps at every block position.
- `commit(slot, n)`: keep the first n tokens of the last verified block, roll back the rest.
Plain decoding is `verify` of one token followed by `commit(slot, 1)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_serve.errors import InvalidRequestError
from dflash_serve.feature_channel import SharedFeatureBuffer
from dflash_serve.slots import SlotAllocator
from target_service.commit_graphs import CommitGraphs
from target_service.config import DEFAULT_PREFILL_CHUNK_TOKENS
from target_service.model.commit import commit_blocks, record_commits
from target_service.model.decoder import Qwen35TextModel
from target_service.model.forward_batch import ForwardBatch, ints_on_device
from target_service.model.state import StateShape, TargetState
from target_service.prefill_graphs import PrefillGraphs, run_padded_prefill
from target_service.verify_graphs import VerifyGraphs

# With verify graphs, prompts up to this length are prefilled as 16-token verify blocks (see
# `prefills_in_blocks`); measured on an H200 (bench.prefill), an eager prefill cost ~60 ms
# of host time below ~1,000 tokens and a replayed block ~5 ms: break-even ~190 tokens. Since
# 532a54e an eager 512-token prefill takes 46-56 ms: break-even ~150-180 tokens. With prefill
# graphs (`prefill_run_tokens`) only a prompt of one block is: it may share a verify.
DEFAULT_BLOCK_PREFILL_MAX_TOKENS = 128


@dataclass(frozen=True)
class PrefillResult:
    last_logits: torch.Tensor  # [vocab] fp32, predicts the token after the prompt
    taps: torch.Tensor | None  # [prompt_len, num_taps * hidden], or None without tap layers


@dataclass(frozen=True)
class VerifyResult:
    # T: the longest block's length; rows past a shorter block's length are padding.
    logits: torch.Tensor  # [B, T, vocab] fp32; row t predicts the token after block token t
    taps: torch.Tensor | None  # [B, T, num_taps * hidden]


class TargetEngine:
    """Owns the model and its preallocated state; callers address sequences by slot."""

    def __init__(
        self,
        model: Qwen35TextModel,
        shape: StateShape,
        tap_layer_ids: tuple[int, ...] = (),
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        share_features: bool = False,
        graph_batch_sizes: tuple[int, ...] = (),
        block_prefill_max_tokens: int | None = None,
        prefill_run_tokens: tuple[int, ...] = (),
        prefill_batch_rows: int | None = None,
        commit_graphs: bool = True,
    ) -> None:
        """share_features: also write taps into a CUDA buffer other processes can map.

        graph_batch_sizes: capture CUDA graphs of the verify step for these batch sizes
        (the model must already run on its GPU kernels, see `use_gpu_kernels`); sizes above
        the slot count are left out. block_prefill_max_tokens: prompts up to this length are
        prefilled as verify blocks (None: DEFAULT_BLOCK_PREFILL_MAX_TOKENS with graphs, where
        the blocks replay them, else 0: never; with prefill graphs one block).
        prefill_run_tokens: prompts from position 0 up to the longest of these lengths are
        prefilled padded to the next one (`prefill_graphs`): captured as CUDA graphs where
        the verify is, else run eagerly; lengths above max_len are left out.
        prefill_batch_rows: prompts of one run length T share a padded forward, up to
        prefill_batch_rows // T of them (`prefill_group_size`), where T is at most the rows
        the model's row-independent kernels take (`use_gpu_kernels`): the shared forward
        then runs on them whatever its rows, so a prompt's bits never depend on its
        companions (on the CPU the reference path's matmuls are row-independent at any row
        count). None: those rows (none on the reference path).
        commit_graphs: also capture the commit for the verify graphs' batch sizes
        (`CommitGraphs`: the eager commit is mostly host time); ignored without verify
        graphs (commits then run eagerly).
        """
        config = model.config
        bad = [i for i in tap_layer_ids if not 0 <= i < config.num_hidden_layers]
        if bad:
            raise InvalidRequestError(
                f"tap_layer_ids {bad} out of range: the target has "
                f"{config.num_hidden_layers} layers (ids 0..{config.num_hidden_layers - 1})"
            )
        self.model = model
        self.config = config
        self.tap_layer_ids = tuple(tap_layer_ids)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.state = TargetState(config, shape, self.dtype, self.device)
        self.slots = SlotAllocator(shape.max_slots, "target")
        self.shared_features: SharedFeatureBuffer | None = None
        if share_features and tap_layer_ids:
            width = len(tap_layer_ids) * config.hidden_size
            self.shared_features = SharedFeatureBuffer(
                shape.max_slots, shape.max_len, width, self.dtype, self.device
            )
        self.graphs: VerifyGraphs | None = None
        # No batch of distinct slots is larger than the slot count.
        graph_batch_sizes = tuple(b for b in graph_batch_sizes if b <= shape.max_slots)
        if graph_batch_sizes:
            most_rows = max(graph_batch_sizes) * shape.max_block_tokens
            if model.recurrence_kernel is None or most_rows > model.max_kernel_rows:
                raise ValueError(
                    f"graph_batch_sizes {graph_batch_sizes}: verify graphs need the kernel path "
                    f"for {most_rows} rows; call model.use_gpu_kernels({most_rows}) first"
                )
            self.graphs = VerifyGraphs(model, self.state, self.tap_layer_ids, graph_batch_sizes)
        self.commit_graphs: CommitGraphs | None = None
        if commit_graphs and self.graphs is not None:
            self.commit_graphs = CommitGraphs(
                self.state, model.recurrence_kernel, graph_batch_sizes
            )
        self.prefill_run_tokens = tuple(sorted(t for t in prefill_run_tokens if t <= shape.max_len))
        if prefill_batch_rows is None:
            prefill_batch_rows = model.max_kernel_rows
        if self.device.type == "cuda" and model.max_kernel_rows == 0 and prefill_batch_rows:
            raise ValueError(
                f"prefill_batch_rows {prefill_batch_rows} without the row-independent kernels: "
                "on cuBLAS a prompt's bits would depend on the prompts sharing its forward "
                "(call model.use_gpu_kernels first, or give 0)"
            )
        self.prefill_batch_rows = prefill_batch_rows
        # Prompts of a group are distinct sessions, and the scheduler's batch bounds them.
        self.max_prefill_group = max(graph_batch_sizes, default=shape.max_slots)
        self.prefill_graphs: PrefillGraphs | None = None
        if self.graphs is not None and self.prefill_run_tokens:
            shapes = tuple(
                (num_prompts, run_tokens)
                for run_tokens in self.prefill_run_tokens
                for num_prompts in range(1, self.prefill_group_size(run_tokens) + 1)
            )
            self.prefill_graphs = PrefillGraphs(model, self.state, self.tap_layer_ids, shapes)
        if block_prefill_max_tokens is None:
            if self.graphs is None:
                block_prefill_max_tokens = 0
            elif self.prefill_graphs is not None:
                block_prefill_max_tokens = shape.max_block_tokens
            else:
                block_prefill_max_tokens = DEFAULT_BLOCK_PREFILL_MAX_TOKENS
        self.block_prefill_max_tokens = block_prefill_max_tokens

    def warm_up(self, max_batch_size: int = 2) -> None:
        """Run once each step outside the verify graphs whose kernels Triton compiles on first
        use, so that they compile (and autotune) at start-up rather than while requests wait:
        a batch commit that replays partial blocks (on the H200 its recurrence variant compiled
        during the first 4-stream round), a single partial commit, and an eager chunked
        prefill (with commit graphs the commits replay them, compiled at capture).
        max_batch_size: the scheduler's (1: no batch step is warmed, as none runs).
        Every slot is free and empty afterwards."""
        shape = self.state.shape
        if shape.max_len < 2 + shape.max_block_tokens:
            return  # too short for a prompt token and two blocks: nothing a request could run
        count = min(2, shape.max_slots, max_batch_size)
        slots = [self.open_sequence() for _ in range(count)]
        try:
            block = [0] * shape.max_block_tokens
            for slot in slots:
                self.prefill(slot, [0])
            self.verify(slots, [block] * count)
            self.commit_many(slots, [1] * count)
            self.verify(slots[:1], [block])
            self.commit(slots[0], 1)
            shortest_chunked = max(self.block_prefill_max_tokens, *self.prefill_run_tokens, 0) + 1
            if shortest_chunked <= shape.max_len:  # from position 0, as a request's
                self.state.reset_slot(slots[0])
                self.prefill(slots[0], [0] * shortest_chunked)
        finally:
            for slot in reversed(slots):  # the allocator hands out the lowest free slot first
                self.state.reset_slot(slot)
                self.close_sequence(slot)

    def open_sequence(self) -> int:
        """Reserve a slot with empty state; CapacityError when all are in use."""
        slot = self.slots.acquire()
        self.state.reset_slot(slot)
        return slot

    def reset_sequence(self, slot: int) -> None:
        """Forget everything the slot committed (a prefill that failed part-way), so that
        the sequence can start again."""
        self._check_slot(slot)
        self.state.reset_slot(slot)

    def close_sequence(self, slot: int) -> None:
        self.slots.release(slot)

    def length(self, slot: int) -> int:
        """Committed tokens of the sequence."""
        return self.state.lengths[slot]

    def check_prompt(self, slot: int, prompt_ids: list[int]) -> None:
        """Raise InvalidRequestError unless `prompt_ids` can be prefilled on `slot` now."""
        self._check_slot(slot)
        if not prompt_ids:
            raise InvalidRequestError("prompt_ids is empty; a prompt needs at least one token")
        self._check_ids(prompt_ids, "prompt_ids")
        self._check_room(slot, len(prompt_ids))

    def prefills_in_blocks(self, num_tokens: int) -> bool:
        """Whether a prompt of `num_tokens` is prefilled as verify blocks, each committed
        whole (`prompt_blocks`): with verify graphs, every block replays one, where an eager
        prefill chunk is ~925 kernel launches, host-bound for short prompts; and the
        blocks of concurrent sessions' prompts can share verifies (see InProcessTarget). The
        result is the verify path's: no less the model's, and both decoding modes share it."""
        return num_tokens <= self.block_prefill_max_tokens

    def prompt_blocks(self, prompt_ids: list[int]) -> list[list[int]]:
        size = self.state.shape.max_block_tokens
        return [prompt_ids[start : start + size] for start in range(0, len(prompt_ids), size)]

    @torch.inference_mode()
    def prefill(self, slot: int, prompt_ids: list[int]) -> PrefillResult:
        """Commit the prompt; if this fails part-way, nothing stays committed."""
        self.check_prompt(slot, prompt_ids)
        try:
            if self.prefills_in_blocks(len(prompt_ids)):
                return self._prefill_in_blocks(slot, prompt_ids)
            run_tokens = self.prefill_run_length(slot, len(prompt_ids))
            if run_tokens is not None:
                return self._prefill_padded([slot], [prompt_ids], run_tokens)[0]
            return self._prefill_in_chunks(slot, prompt_ids)
        except Exception:
            self.reset_sequence(slot)
            raise

    def prefill_run_length(self, slot: int, num_tokens: int) -> int | None:
        """The padded length a prompt of `num_tokens` runs at on this slot, or None (eager
        chunks): the shortest of `prefill_run_tokens` that holds it, from position 0 only."""
        if self.state.lengths[slot] != 0:
            return None
        return next((t for t in self.prefill_run_tokens if t >= num_tokens), None)

    def prefill_group_size(self, run_tokens: int) -> int:
        """How many prompts of run length `run_tokens` may share one padded forward (1:
        each runs alone): as many as fit in `prefill_batch_rows` rows, if one alone takes
        the row kernels (a longer one runs alone on cuBLAS, faster at that many rows)."""
        if self.model.max_kernel_rows and not self.model.takes_row_kernels_alone(run_tokens):
            return 1
        return max(1, min(self.prefill_batch_rows // run_tokens, self.max_prefill_group))

    def shares_prefills(self, slot: int, num_tokens: int) -> bool:
        """Whether a prompt of `num_tokens` on this slot may share its forward with other
        sessions' prompts (`prefill_together`; InProcessTarget batches it then)."""
        run_tokens = self.prefill_run_length(slot, num_tokens)
        return run_tokens is not None and self.prefill_group_size(run_tokens) > 1

    @torch.inference_mode()
    def prefill_together(self, slots: list[int], prompts: list[list[int]]) -> list[PrefillResult]:
        """Commit several sessions' prompts in one padded forward, one row each: all from
        position 0, of one run length, at most `prefill_group_size` of them. Each result is
        bit for bit the prompt's prefill alone (the row-independent kernels, an attention
        call per prompt). If the forward fails, nothing stays committed on any slot."""
        if len(slots) != len(prompts) or len(set(slots)) != len(slots) or not slots:
            raise InvalidRequestError(
                f"prefill_together needs distinct slots, one prompt each; got {slots} and "
                f"{len(prompts)} prompts"
            )
        for slot, prompt_ids in zip(slots, prompts, strict=True):
            self.check_prompt(slot, prompt_ids)
        run_tokens = {
            self.prefill_run_length(s, len(p)) for s, p in zip(slots, prompts, strict=True)
        }
        if len(run_tokens) != 1 or None in run_tokens:
            raise InvalidRequestError(
                f"prompts prefilled together need one run length from position 0; got {run_tokens}"
            )
        (run_length,) = run_tokens
        if len(slots) > self.prefill_group_size(run_length):
            raise InvalidRequestError(
                f"{len(slots)} prompts of run length {run_length}: at most "
                f"{self.prefill_group_size(run_length)} share a forward"
            )
        try:
            return self._prefill_padded(slots, prompts, run_length)
        except Exception:
            for slot in slots:
                self.reset_sequence(slot)
            raise

    def _prefill_padded(
        self, slots: list[int], prompts: list[list[int]], run_tokens: int
    ) -> list[PrefillResult]:
        last_logits, taps = run_padded_prefill(
            self.model, self.state, self.tap_layer_ids, self.prefill_graphs, slots, prompts,
            run_tokens,
        )  # fmt: skip
        results = []
        for row, (slot, ids) in enumerate(zip(slots, prompts, strict=True)):
            prompt_taps = None if taps is None else taps[row, : len(ids)]
            if prompt_taps is not None:
                self._share(slot, 0, prompt_taps)
            self.state.lengths[slot] = len(ids)
            results.append(PrefillResult(last_logits[row], prompt_taps))
        return results

    def _prefill_in_chunks(self, slot: int, prompt_ids: list[int]) -> PrefillResult:
        """Eager forwards of `prefill_chunk_tokens` tokens. Every chunk's token ids, slot and
        start position reach the device in one non-blocking copy before the first forward,
        and the layers read them there: on a GPU each blocking copy from a Python list (one
        per layer and chunk) made the host wait for all queued work, so the host stopped
        queueing the next kernels while the GPU ran, and the two took turns."""
        size, num_ids = self.prefill_chunk_tokens, len(prompt_ids)
        chunk_starts = range(0, num_ids, size)
        first = self.state.lengths[slot]
        packed = [*prompt_ids, slot, *(first + start for start in chunk_starts)]
        on_device = ints_on_device(packed, self.device)
        all_ids, slot_ids, start_ids = on_device.split([num_ids, 1, len(chunk_starts)])
        taps = []
        hidden = None
        for index, start in enumerate(chunk_starts):
            num_tokens = min(size, num_ids - start)
            batch = ForwardBatch(
                (slot,),
                (self.state.lengths[slot],),
                num_tokens,
                is_verify=False,
                slot_ids=slot_ids,
                start_ids=start_ids[index : index + 1],
            )
            ids = all_ids[start : start + num_tokens].unsqueeze(0)
            hidden, tapped = self.model(ids, batch, self.state, self.tap_layer_ids)
            if tapped is not None:
                taps.append(tapped[0])
                self._share(slot, self.state.lengths[slot], tapped[0])
            self.state.lengths[slot] += num_tokens
        last_logits = self.model.logits(hidden[0, -1])
        return PrefillResult(last_logits, torch.cat(taps) if taps else None)

    def _prefill_in_blocks(self, slot: int, prompt_ids: list[int]) -> PrefillResult:
        taps = []
        for block in self.prompt_blocks(prompt_ids):
            result = self.verify([slot], [block])
            self.commit(slot, len(block))
            if result.taps is not None:
                taps.append(result.taps[0])
        return PrefillResult(result.logits[0, -1], torch.cat(taps) if taps else None)

    @torch.inference_mode()
    def verify(self, slots: list[int], block_ids: list[list[int]]) -> VerifyResult:
        """Run one block per sequence without committing, all in one forward. Blocks of
        different lengths are padded after their last token to the longest: a padding row
        comes after every real row of its block, so (causal, row-independent kernels) the
        real rows are those of the block alone; the result's rows past a block's own length
        are padding."""
        if len(slots) != len(block_ids) or not slots:
            raise InvalidRequestError(
                f"verify needs one block per slot; got {len(slots)} slots, {len(block_ids)} blocks"
            )
        if len(set(slots)) != len(slots):
            raise InvalidRequestError(f"verify got a slot twice: {slots}")
        for slot, block in zip(slots, block_ids, strict=True):
            self.check_block(slot, block)
        lengths = [len(block) for block in block_ids]
        num_tokens = max(lengths)
        run_length = None if self.graphs is None else self.graphs.run_length(len(slots), num_tokens)
        run_tokens = num_tokens if run_length is None else run_length
        padded = [block + [block[-1]] * (run_tokens - len(block)) for block in block_ids]
        starts = tuple(self.state.lengths[s] for s in slots)
        if run_length is None:
            batch = ForwardBatch(tuple(slots), starts, run_tokens, is_verify=True)
            ids = ints_on_device(padded, self.device)
            hidden, taps = self.model(
                ids, batch.on_device(self.device), self.state, self.tap_layer_ids
            )
            logits = self.model.logits(hidden)
        else:
            logits, taps = self.graphs.replay(slots, starts, padded)
            logits = logits[:, :num_tokens]  # the graph's padding past the longest block
            taps = None if taps is None else taps[:, :num_tokens]
        for row, slot in enumerate(slots):
            self.state.block_sizes[slot] = lengths[row]
            self.state.block_run_sizes[slot] = run_tokens
            if taps is not None:
                self._share(slot, starts[row], taps[row, : lengths[row]])
        return VerifyResult(logits, taps)

    def check_block(self, slot: int, block_ids: list[int]) -> None:
        """Raise InvalidRequestError unless `block_ids` can be verified on `slot` now."""
        self._check_slot(slot)
        limit = self.state.shape.max_block_tokens
        if not 1 <= len(block_ids) <= limit:
            raise InvalidRequestError(
                f"a block holds 1..{limit} tokens (anchor + drafts); got {len(block_ids)}"
            )
        self._check_ids(block_ids, "block_ids")
        self._check_room(slot, len(block_ids))

    def commit(self, slot: int, num_kept: int) -> None:
        """Keep the first `num_kept` tokens of the slot's last verified block."""
        self.commit_many([slot], [num_kept])

    @torch.inference_mode()
    def commit_many(self, slots: list[int], num_kept: list[int]) -> None:
        """Keep the first `num_kept[i]` tokens of each slot's last verified block, in a few
        launches for the whole batch. Every slot is checked first: an invalid one raises
        InvalidRequestError and none is committed."""
        if len(slots) != len(num_kept) or len(set(slots)) != len(slots):
            raise InvalidRequestError(
                f"commit needs distinct slots, one count each; got {slots} and {num_kept}"
            )
        for slot, kept in zip(slots, num_kept, strict=True):
            self._check_slot(slot)
            block_size = self.state.block_sizes[slot]
            if block_size == 0:
                raise InvalidRequestError(f"slot {slot}: commit without a verified block")
            if not 1 <= kept <= block_size:
                raise InvalidRequestError(
                    f"slot {slot}: num_kept must be in 1..{block_size}, got {kept}"
                )
        if not slots:
            return
        if self.commit_graphs is not None and self.commit_graphs.has(len(slots)):
            self.commit_graphs.replay(slots, num_kept)
            record_commits(self.state, slots, num_kept)
        else:
            commit_blocks(self.state, slots, num_kept, self.model.recurrence_kernel)

    def _share(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Rows beyond what is later committed are overwritten by the next block."""
        if self.shared_features is not None:
            self.shared_features.write(slot, start, rows)

    def _check_slot(self, slot: int) -> None:
        self.slots.check_open(slot)

    def _check_ids(self, ids: list[int], what: str) -> None:
        vocab = self.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise InvalidRequestError(
                f"{what}: token ids {bad[:5]} outside the vocabulary 0..{vocab - 1}"
            )

    def _check_room(self, slot: int, num_new: int) -> None:
        max_len = self.state.shape.max_len
        if self.state.lengths[slot] + num_new > max_len:
            raise InvalidRequestError(
                f"slot {slot}: {self.state.lengths[slot]} committed + {num_new} new tokens "
                f"exceed max_len {max_len}"
            )
