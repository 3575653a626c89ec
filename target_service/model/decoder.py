"""The Qwen3.5 text model: embeddings, hybrid decoder layers, final norm, (tied) head."""

from __future__ import annotations

import torch
from torch import nn

from dflash_serve.layers.int4_reads import (
    INT4_READS,
    PREFILL_INT4_READS_DEFAULT,
    check_int4_reads,
)
from dflash_serve.layers.linear import (
    Int4Linear,
    RowIndependentLinear,
    fits_row_kernel,
    reading_bf16_copies,
    row_kernel_linear,
    row_kernels_up_to,
    row_stable_linear,
)
from dflash_serve.layers.mlp import SwiGLU
from dflash_serve.layers.norms import GatedRMSNorm, RMSNorm
from dflash_serve.layers.rotary import RotaryEmbedding
from dflash_serve.layers.split_sums import SplitSums
from dflash_serve.qwen35_config import FULL_ATTENTION, Qwen35TextConfig
from target_service.model.forward_batch import ForwardBatch
from target_service.model.gated_attention import GatedAttention
from target_service.model.gated_deltanet import GatedDeltaNet
from target_service.model.state import TargetState


class DecoderLayer(nn.Module):
    """h += mixer(input_norm(h)); h += mlp(post_norm(h)); the mixer is attention or GDN.

    The MLP's output is handed on, not added: the next norm adds it (`add_and_norm`, one
    kernel on the kernel path), so each residual add shares a pass with the norm after it."""

    def __init__(self, config: Qwen35TextConfig, layer_id: int) -> None:
        super().__init__()
        self.is_attention = config.layer_types[layer_id] == FULL_ATTENTION
        if self.is_attention:
            attn_index = config.attention_layer_ids.index(layer_id)
            self.self_attn = GatedAttention(config, attn_index)
        else:
            self.linear_attn = GatedDeltaNet(config, config.gdn_layer_ids.index(layer_id))
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, zero_centred=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zero_centred=True)

    def hand_splits_to_residual_adds(self) -> None:
        """The mixer's output projection and the MLP's down projection feed only the residual
        adds after them, which sum split-K partial sums themselves (one launch less each)."""
        mixer = self.self_attn.o_proj if self.is_attention else self.linear_attn.out_proj
        for linear in (mixer, self.mlp.down_proj):
            linear.keeps_splits = True

    def forward(
        self, h, pending: torch.Tensor | None, batch: ForwardBatch, state: TargetState, cos_sin
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | SplitSums]:
        """(h, pending) → (the previous layer's output h + pending, h, this layer's MLP
        output); this layer's output is the sum of the last two. pending: the previous
        layer's MLP output, not yet added to h (None for layer 0: the first result is h). On
        the kernel path the mixer's and the MLP's outputs may be split-K partial sums, which
        the add after them sums (`RowIndependentLinear.keeps_splits`)."""
        if pending is None:
            normed = self.input_layernorm(h)
        else:
            h, normed = self.input_layernorm.add_and_norm(h, pending)
        layer_input = h
        if self.is_attention:
            mixed = self.self_attn(normed, batch, state, cos_sin)
        else:
            mixed = self.linear_attn(normed, batch, state)
        h, normed = self.post_attention_layernorm.add_and_norm(h, mixed)
        return layer_input, h, self.mlp(normed)


class Qwen35TextModel(nn.Module):
    """Our forward over new tokens of several sequences; state lives in a TargetState."""

    def __init__(self, config: Qwen35TextConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centred=True)
        self.lm_head: nn.Module | None = None  # set by the loader when not tied
        self.max_kernel_rows = 0
        self.prefill_reads_bf16_copies = False  # set by use_gpu_kernels
        self.recurrence_kernel = None  # the GDN recurrence the verify runs, for commit's replay

    def use_gpu_kernels(
        self,
        max_kernel_rows: int,
        int4_reads: str = INT4_READS[0],
        prefill_int4_reads: str = PREFILL_INT4_READS_DEFAULT,
    ) -> None:
        """Run verify/decode on the row-independent Triton kernels (CUDA, Triton needed).

        Calls of at most `max_kernel_rows` rows (tokens × sequences) take the kernels, and
        larger ones inside `row_kernels_for_prompts`; a speculative step must fit, so that
        its rows equal the same rows decoded alone.
        `int4_reads`: what the kernels read for 4-bit layers (`INT4_READS`) on verify and
        decode; `prefill_int4_reads`: on prefill forwards (`reading_bf16_copies`).
        """
        check_int4_reads(int4_reads, prefill_int4_reads)
        self.prefill_reads_bf16_copies = prefill_int4_reads == "bf16"
        for module in self.modules():
            if isinstance(module, Int4Linear):
                module.use_row_kernel(max_kernel_rows, int4_reads)
            elif isinstance(module, RowIndependentLinear):
                module.use_row_kernel(max_kernel_rows)
            elif isinstance(module, RMSNorm | GatedRMSNorm):
                module.use_row_kernel()
            elif isinstance(module, GatedDeltaNet | GatedAttention):
                module.use_gpu_kernels()
        for module in self.modules():  # after every linear has its kernel weight
            if isinstance(module, SwiGLU | GatedDeltaNet | GatedAttention):
                module.fuse_row_kernels()
        for layer in self.layers:  # (here: the loader may have replaced them by 4-bit layers)
            layer.hand_splits_to_residual_adds()
        from target_service.kernels.gated_delta_recurrence import recurrent_gated_delta

        self.max_kernel_rows = max_kernel_rows
        self.recurrence_kernel = recurrent_gated_delta

    def takes_row_kernels_alone(self, run_tokens: int) -> bool:
        """Whether one prompt padded to `run_tokens` runs on the row kernels (the kernel path
        is on and its rows fit): the prompts that may share a prefill forward on that path."""
        return 0 < run_tokens <= self.max_kernel_rows

    def row_kernels_for_prompts(self, num_prompts: int, run_tokens: int):
        """A context for the forward of `num_prompts` prompts padded to `run_tokens`: where one
        such prompt alone takes the row kernels, all of them together take them too, however
        many rows that makes (the kernels' wide launch), so each prompt keeps its bits;
        longer prompts stay on cuBLAS, alone."""
        sharing = self.takes_row_kernels_alone(run_tokens)
        return row_kernels_up_to(num_prompts * run_tokens if sharing else 0)

    @property
    def head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: `lm_head.weight`, or the embeddings when they are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        token_ids: torch.Tensor,
        batch: ForwardBatch,
        state: TargetState,
        tap_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """token_ids [B, T] → (final-normed hidden [B, T, hidden], taps [B, T, n·hidden] or None).

        Taps are the outputs of the listed decoder layers (transformers' hidden_states[i+1]),
        concatenated in the listed order.
        """
        h, pending = self.embed_tokens(token_ids), None
        batch = batch.with_positions(token_ids.device)
        cos_sin = self.rotary.cos_sin(batch.positions(token_ids.device))
        outputs = {}  # a layer's output is the next residual add's sum: no add of its own
        with reading_bf16_copies(self.prefill_reads_bf16_copies and not batch.is_verify):
            for layer_id, layer in enumerate(self.layers):
                outputs[layer_id - 1], h, pending = layer(h, pending, batch, state, cos_sin)
        outputs[len(self.layers) - 1], final = self.norm.add_and_norm(h, pending)
        tapped = torch.cat([outputs[i] for i in tap_layer_ids], dim=-1) if tap_layer_ids else None
        return final, tapped

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., hidden] → fp32 logits [..., vocab]."""
        if fits_row_kernel(hidden, self.max_kernel_rows):
            return row_kernel_linear(hidden, self.head_weight).float()
        return row_stable_linear(hidden, self.head_weight).float()
