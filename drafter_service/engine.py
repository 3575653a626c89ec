"""The drafter engine: context caches per slot, and batched greedy drafting.

A draft is the argmax of the drafter's logits at each block position: acceptance is by
equality with the target's token, so the most likely token is the best proposal whatever
the target's sampling parameters.

Every draft is the first tokens of a full block (anchor + block_size − 1 masks), on every
path: the drafter is trained on full blocks and its block positions attend to each other, so
a shorter block proposes other, much worse tokens (the shipped pair on the CPU: τ 6.9 with 15
drafts, 1.6 with 11 from a 12-token block). On a model running its GPU kernels, drafts of
captured batch sizes replay a CUDA graph (`DraftGraphs`) of that block; batch sizes that were
not captured run the same kernels eagerly. Context rows beyond a block (a first draft's
prompt) are added before the draft, every slot's in one forward, replayed as a graph of
padded rows (`ContextGraphs`) where one holds them.

A step that drafts nothing (the gateway paces drafting out while drafting does not pay) only
hands over the committed tokens' features: they wait (`defer_context`) and enter the cache
with the slot's next draft, in the same forward, inside its graph when they fit, instead of
costing an eager forward of a few rows at every paced-out step.
"""

from __future__ import annotations

import logging

import torch

from dflash_serve.errors import InvalidRequestError
from dflash_serve.slots import SlotAllocator
from drafter_service.context_graphs import ContextGraphs
from drafter_service.draft_graphs import DRAFT_BLOCK_TOKENS, MAX_NEW_CONTEXT, DraftGraphs
from drafter_service.model.context_cache import DrafterContextCache
from drafter_service.model.dflash import DFlashDrafter

logger = logging.getLogger(__name__)


class DrafterEngine:
    def __init__(
        self,
        model: DFlashDrafter,
        max_slots: int,
        max_len: int,
        graph_batch_sizes: tuple[int, ...] = (),
    ) -> None:
        """graph_batch_sizes: capture CUDA graphs of the full-block draft step for these batch
        sizes (the model must already run on its GPU kernels, see `use_gpu_kernels`), and of
        a batch's leading context rows (`ContextGraphs`); sizes above max_slots are left
        out, as no batch of distinct slots reaches them."""
        if graph_batch_sizes and not model.uses_gpu_kernels:
            raise ValueError(
                f"graph_batch_sizes {graph_batch_sizes}: CUDA graphs need a model on its GPU "
                f"kernels (call model.use_gpu_kernels() first)"
            )
        self.model = model
        self.config = model.config
        self.vocab_size = model.embed_weight.shape[0]
        self.feature_dim = len(self.config.target_layer_ids) * self.config.hidden_size
        self.device = model.embed_weight.device
        dtype = model.fc.weight.dtype
        self.cache = DrafterContextCache(self.config, max_slots, max_len, dtype, self.device)
        self.slots = SlotAllocator(max_slots, "drafter")
        self.deferred: dict[int, list[torch.Tensor]] = {}  # slot -> feature rows, oldest first
        self.graphs: DraftGraphs | None = None
        self.context_graphs: ContextGraphs | None = None  # a draft batch's leading rows
        batch_sizes = tuple(b for b in graph_batch_sizes if b <= max_slots)
        if batch_sizes and self.config.block_size != DRAFT_BLOCK_TOKENS:
            # The graph pads context to a target block and writes a full block past max_len.
            logger.warning(
                "no draft graphs: they are built for %d-token blocks, this drafter's block_size "
                "is %d; drafts run eagerly",
                DRAFT_BLOCK_TOKENS,
                self.config.block_size,
            )
        elif batch_sizes:
            self.graphs = DraftGraphs(model, self.cache, batch_sizes)
            self.context_graphs = ContextGraphs(model, self.cache, max(batch_sizes) * max_len)

    def open_sequence(self) -> int:
        slot = self.slots.acquire()
        self.cache.lengths[slot] = 0
        self.deferred.pop(slot, None)
        return slot

    def close_sequence(self, slot: int) -> None:
        self.deferred.pop(slot, None)
        self.slots.release(slot)

    def context_length(self, slot: int) -> int:
        """Context tokens of the slot, deferred ones included."""
        return self.cache.lengths[slot] + self._num_deferred(slot)

    @torch.inference_mode()
    def add_context(self, slot: int, features: torch.Tensor) -> None:
        """Append the tapped target features [n, taps·hidden] of n committed tokens."""
        self.check_context(slot, features)
        self.model.add_context(self.cache, slot, self._with_deferred(slot, features))

    @torch.inference_mode()
    def defer_context(self, slot: int, features: torch.Tensor) -> None:
        """`add_context` without a forward now: the rows join the slot's next draft (or
        add_context). Copied, as a caller's buffer (the target's shared features) may be
        reused before then."""
        self.check_context(slot, features)
        self.deferred.setdefault(slot, []).append(features.to(self.device, copy=True))

    def check_context(self, slot: int, features: torch.Tensor, num_drafts: int = 0) -> None:
        """Raise InvalidRequestError unless `features` (and then a block of `num_drafts`
        drafts) can be added to the slot now."""
        self._check_slot(slot)
        if features.ndim != 2 or features.shape[1] != self.feature_dim:
            raise InvalidRequestError(
                f"features must be [tokens, {self.feature_dim}] "
                f"({len(self.config.target_layer_ids)} taps × hidden {self.config.hidden_size}); "
                f"got {list(features.shape)}"
            )
        if self.context_length(slot) + features.shape[0] > self.cache.max_len:
            raise InvalidRequestError(
                f"slot {slot}: context would exceed max_len {self.cache.max_len}"
            )
        if num_drafts:
            self._check_block_room(slot, features.shape[0], num_drafts)

    @torch.inference_mode()
    def add_context_and_draft(
        self,
        slots: list[int],
        features: list[torch.Tensor],
        anchor_ids: list[int],
        num_drafts: int,
    ) -> list[list[int]]:
        """`add_context` for every slot, then `draft`: one CUDA graph for both when one was
        captured for this shape, else the same steps one by one."""
        for slot, rows in zip(slots, features, strict=True):
            self.check_context(slot, rows, num_drafts)
        self._check_draft(slots, anchor_ids, num_drafts)
        features = [
            self._with_deferred(slot, rows) for slot, rows in zip(slots, features, strict=True)
        ]
        graph_rows = [min(rows.shape[0], MAX_NEW_CONTEXT) for rows in features]
        if self._graph_fits(slots, graph_rows, num_drafts):  # else all rows in one call
            tails = self._add_leading_rows(slots, features)
            return self._replay(slots, tails, anchor_ids, num_drafts)
        for slot, rows in zip(slots, features, strict=True):
            self.model.add_context(self.cache, slot, rows.to(self.device))
        return self._draft_checked(slots, anchor_ids, num_drafts)

    @torch.inference_mode()
    def draft(self, slots: list[int], anchor_ids: list[int], num_drafts: int) -> list[list[int]]:
        """Propose `num_drafts` tokens after each anchor (one forward for all slots)."""
        self._check_draft(slots, anchor_ids, num_drafts)
        for slot in slots:
            self._check_block_room(slot, 0, num_drafts)
        for slot in slots:
            if slot in self.deferred:
                self.model.add_context(self.cache, slot, torch.cat(self.deferred.pop(slot)))
        return self._draft_checked(slots, anchor_ids, num_drafts)

    def _graph_fits(self, slots: list[int], num_new: list[int], num_drafts: int) -> bool:
        """Whether a captured graph can add this context and draft `num_drafts` tokens (as
        the first ones of a full block: the cache has a block of room past max_len)."""
        return (
            self.graphs is not None
            and num_drafts <= self.graphs.block_tokens - 1
            and self.graphs.accepts(len(slots), self.graphs.block_tokens, num_new)
        )

    def _add_leading_rows(self, slots: list[int], features: list[torch.Tensor]):
        """Add all but the last MAX_NEW_CONTEXT rows of each slot's features now and return
        the rests: a request's first draft brings its prompt's features (hundreds of rows),
        and a draft after paced-out steps their deferred rows too, more than a graph takes;
        they would otherwise send every request batched with it down the eager path. The
        slots' leading rows go in one forward (`DFlashDrafter.add_contexts`), replayed as a
        graph where one holds them (`ContextGraphs`): sessions that start together bring
        their prompts to the same first draft, and an eager forward per slot cost each slot
        its own launches, one after another."""
        leading = {}
        tails = []
        for slot, rows in zip(slots, features, strict=True):
            split = max(rows.shape[0] - MAX_NEW_CONTEXT, 0)
            if split:
                leading[slot] = rows[:split].to(self.device)
            tails.append(rows[split:])
        if leading:
            leading_slots, leading_rows = list(leading), list(leading.values())
            graphs = self.context_graphs
            if graphs is None or not graphs.add(leading_slots, leading_rows):
                self.model.add_contexts(self.cache, leading_slots, leading_rows)
        return tails

    def _replay(self, slots, features, anchor_ids, num_drafts: int) -> list[list[int]]:
        """The graph's full-block drafts after adding the context, cut to `num_drafts`
        (arguments as `add_context_and_draft`'s, checked)."""
        starts = [self.cache.lengths[slot] for slot in slots]
        on_device = [rows.to(self.device) for rows in features]
        block = self._blocks(anchor_ids, self.graphs.block_tokens - 1)
        draft_ids = self.graphs.replay(slots, starts, on_device, block)
        for slot, rows in zip(slots, features, strict=True):
            self.cache.lengths[slot] += rows.shape[0]
        return [ids[:num_drafts] for ids in draft_ids.tolist()]

    def _num_deferred(self, slot: int) -> int:
        return sum(rows.shape[0] for rows in self.deferred.get(slot, ()))

    def _with_deferred(self, slot: int, features: torch.Tensor) -> torch.Tensor:
        """The slot's deferred rows, then `features`, on the device; the slot keeps none
        (call once its request has been checked: the rows are then the cache's to add). A
        forward that then fails with anything but a DflashError leaves the slot's context
        undefined, as it did before deferral: the loop stops using the drafter for the request.
        """
        rows = features.to(self.device)
        deferred = self.deferred.pop(slot, None)
        return rows if deferred is None else torch.cat([*deferred, rows.to(deferred[0].dtype)])

    def _check_block_room(self, slot: int, num_new_context: int, num_drafts: int) -> None:
        """The anchor and drafts must fit after the context (and its new rows)."""
        if self.context_length(slot) + num_new_context + num_drafts + 1 > self.cache.max_len:
            raise InvalidRequestError(f"slot {slot}: block would exceed max_len")

    def _blocks(self, anchor_ids: list[int], num_drafts: int) -> list[list[int]]:
        mask = self.config.mask_token_id
        return [[anchor] + [mask] * num_drafts for anchor in anchor_ids]

    def _check_draft(self, slots: list[int], anchor_ids: list[int], num_drafts: int) -> None:
        if not 1 <= num_drafts <= self.config.max_drafts:
            raise InvalidRequestError(
                f"num_drafts must be in 1..{self.config.max_drafts}, got {num_drafts}"
            )
        if len(slots) != len(anchor_ids) or not slots:
            raise InvalidRequestError("draft needs one anchor per slot")
        if len(set(slots)) != len(slots):
            raise InvalidRequestError(f"draft got a slot twice: {slots}")
        for slot, anchor in zip(slots, anchor_ids, strict=True):
            self._check_slot(slot)
            if not 0 <= anchor < self.vocab_size:
                raise InvalidRequestError(f"anchor id {anchor} outside the vocabulary")

    def _draft_checked(
        self, slots: list[int], anchor_ids: list[int], num_drafts: int
    ) -> list[list[int]]:
        if self._graph_fits(slots, [0] * len(slots), num_drafts):
            no_context = [torch.empty(0, self.feature_dim, device=self.device)] * len(slots)
            return self._replay(slots, no_context, anchor_ids, num_drafts)
        ids = torch.tensor(self._blocks(anchor_ids, self.config.max_drafts), device=self.device)
        logits = self.model.draft_logits(self.cache, slots, ids)
        return logits[:, :num_drafts].argmax(dim=-1).tolist()

    def _check_slot(self, slot: int) -> None:
        self.slots.check_open(slot)
