"""Engine-level measurements: verify and draft steps per layout, autoregressive decode (ours
and transformers'), state sizes, and whether speculative greedy output equals plain decoding."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import torch

from bench.timing import median_ms, synchronize
from dflash_serve.checkpoint.safetensors_reader import TensorReader
from dflash_serve.layers.int4_reads import INT4_READS, PREFILL_INT4_READS_DEFAULT
from dflash_serve.speculative.loop import SpeculativeGeneration, StopRules
from dflash_serve.speculative.scripted_drafter import ScriptedDrafter
from dflash_serve.speculative.types import SamplingParams
from drafter_service.engine import DrafterEngine
from target_service.config import DEFAULT_PREFILL_BATCH_ROWS, DEFAULT_PREFILL_GRAPH_TOKENS
from target_service.engine import TargetEngine
from target_service.model.state import StateShape
from target_service.session import InProcessTarget

logger = logging.getLogger(__name__)

BLOCK = 16


def weight_bytes_per_forward(model_dir: Path) -> int:
    """Bytes one forward must read: every stored tensor, except that of the embedding table
    only the (tied) head's full read counts — a lookup reads a few rows."""
    reader = TensorReader(model_dir)
    return sum(reader.nbytes(name) for name in reader.names())


def verify_step_ms(engine: TargetEngine, prompt_len: int = 512, batch: int = 1) -> float:
    """Median time of verify(16 tokens) + commit for `batch` sequences (commit of 1 token)."""
    slots = [engine.open_sequence() for _ in range(batch)]
    for slot in slots:
        engine.prefill(slot, [(i * 31) % 500 for i in range(prompt_len)])
    blocks = [[(i * 7 + j) % 500 for j in range(BLOCK)] for i in range(batch)]

    def step():
        engine.verify(slots, blocks)
        for slot in slots:
            engine.commit(slot, 1)

    ms = median_ms(step, repeats=10)
    for slot in slots:
        engine.close_sequence(slot)
    return ms


def draft_step_ms(engine: DrafterEngine, context_len: int = 512) -> float:
    slot = engine.open_sequence()
    width = engine.feature_dim
    engine.add_context(
        slot,
        torch.randn(context_len, width, device=engine.device, dtype=engine.model.fc.weight.dtype),
    )
    ms = median_ms(lambda: engine.draft([slot], [5], BLOCK - 1), repeats=10)
    engine.close_sequence(slot)
    return ms


def ours_decode_tok_s(engine: TargetEngine, num_tokens: int = 64) -> float:
    slot = engine.open_sequence()
    engine.prefill(slot, list(range(1, 33)))
    token = 7
    synchronize()
    began = time.perf_counter()
    for _ in range(num_tokens):
        logits = engine.verify([slot], [[token]]).logits
        engine.commit(slot, 1)
        token = int(logits[0, -1].argmax())
    synchronize()
    engine.close_sequence(slot)
    return num_tokens / (time.perf_counter() - began)


def transformers_decode_tok_s(model_dir: Path, device: str = "cuda", num_tokens: int = 32) -> dict:
    """transformers' own Qwen3_5 generate() on the same bf16 weights."""
    from transformers import Qwen3_5ForCausalLM
    from transformers.utils.import_utils import is_flash_linear_attention_available

    model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    ids = torch.arange(1, 33, device=device).unsqueeze(0)
    kwargs = dict(max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)
    model.generate(ids, max_new_tokens=4, do_sample=False)
    synchronize()
    began = time.perf_counter()
    model.generate(ids, **kwargs)
    synchronize()
    tok_s = num_tokens / (time.perf_counter() - began)
    del model

    return {"tok_s": tok_s, "fla_installed": bool(is_flash_linear_attention_available())}


def spec_equals_ar(
    engine: TargetEngine, drafter: DrafterEngine | None, batch: int, num_tokens: int = 48
) -> dict:
    """Greedy output of target-only decoding vs speculative (scripted full acceptance, so
    blocks of 16 are verified), `batch` sequences stepped together."""
    target = InProcessTarget(engine, max_batch_size=batch, max_wait_us=2000)
    prompts = [[(i * 13 + j * 5) % 500 + 1 for j in range(40 + i)] for i in range(batch)]

    async def run(drafters):
        async def one(prompt, drafter_session):
            session = await target.open(SamplingParams())
            gen = SpeculativeGeneration(
                session,
                drafter_session,
                prompt,
                StopRules(num_tokens),
                15,
                engine.state.shape.max_len,
            )
            tokens = [t async for t in gen.tokens()]
            await session.close()
            return tokens

        return await asyncio.gather(*(one(p, d) for p, d in zip(prompts, drafters, strict=True)))

    plain = asyncio.run(run([None] * batch))
    vocab = engine.config.vocab_size
    scripted = [ScriptedDrafter(tokens, [15], vocab) for tokens in plain]
    speculative = asyncio.run(run(scripted))
    target.close()
    mismatches = [
        next((i for i, (a, b) in enumerate(zip(p, s, strict=False)) if a != b), None)
        for p, s in zip(plain, speculative, strict=True)
    ]
    margins = [
        None if i is None else logit_margin(engine, prompts[k], plain[k], speculative[k][i], i)
        for k, i in enumerate(mismatches)
    ]
    return {
        "equal": plain == speculative,
        "first_mismatch_per_sequence": mismatches,
        # plain logit of the plain token minus that of the speculative one, at the mismatch
        "logit_margin_at_mismatch": margins,
    }


def logit_margin(engine: TargetEngine, prompt, plain_tokens, other_token: int, index: int):
    """How close the plain path was to choosing `other_token` at output position `index`."""
    slot = engine.open_sequence()
    logits = engine.prefill(slot, prompt).last_logits
    for token in plain_tokens[:index]:
        logits = engine.verify([slot], [[token]]).logits[0, 0]
        engine.commit(slot, 1)
    engine.close_sequence(slot)
    return float(logits[plain_tokens[index]] - logits[other_token])


def state_bytes(engine: TargetEngine) -> dict:
    sizes = engine.state.bytes_per_sequence()
    positions = engine.state.key_cache.shape[2]  # max_len plus one block of padding room
    return {
        "recurrent_states_per_seq": sizes["recurrent_states"],
        "conv_state_per_seq": sizes["conv_state"],
        "block_inputs_per_seq": sizes["block_inputs"],
        "kv_bytes_per_token": sizes["kv_cache"] // positions,
        "gpu_allocated_bytes": torch.cuda.memory_allocated() if torch.cuda.is_available() else 0,
    }


def build_target(
    model_dir: Path,
    max_slots: int,
    max_len: int,
    device: str = "cuda",
    taps=(),
    fast_path: bool = True,
    int4_reads: str = INT4_READS[0],
    prefill_int4_reads: str = PREFILL_INT4_READS_DEFAULT,
    prefill_graph_tokens: tuple[int, ...] = DEFAULT_PREFILL_GRAPH_TOKENS,
    prefill_batch_rows: int = DEFAULT_PREFILL_BATCH_ROWS,
    commit_graphs: bool = True,
) -> TargetEngine:
    """As the target service builds it: on a GPU, Triton kernels for up to max_slots × 16
    rows, verify graphs for batches of 1..max_slots and prefill graphs (unless `fast_path`
    is off: the plain-torch reference path); `int4_reads`, `prefill_int4_reads`,
    `prefill_graph_tokens`, `prefill_batch_rows` and `commit_graphs` as the service's flags."""
    from target_service.model.loader import load_target_model

    model = load_target_model(model_dir, torch.bfloat16, device)
    graph_batch_sizes, prefill_run_tokens = (), ()
    if fast_path and device.startswith("cuda"):
        model.use_gpu_kernels(max_slots * BLOCK, int4_reads, prefill_int4_reads)
        graph_batch_sizes = tuple(range(1, max_slots + 1))
        prefill_run_tokens = prefill_graph_tokens
    shape = StateShape(max_slots, max_len)
    return TargetEngine(
        model,
        shape,
        taps,
        graph_batch_sizes=graph_batch_sizes,
        prefill_run_tokens=prefill_run_tokens,
        prefill_batch_rows=prefill_batch_rows if prefill_run_tokens else None,
        commit_graphs=commit_graphs,
    )


def build_drafter(
    drafter_dir: Path,
    target_dir: Path,
    max_slots: int,
    max_len: int,
    device: str = "cuda",
    fast_path: bool = True,
):
    """As the drafter service builds it: on a GPU, the Triton attention kernel and draft
    graphs for batches of 1..max_slots (unless `fast_path` is off)."""
    from drafter_service.engine import DrafterEngine
    from drafter_service.model.loader import load_drafter

    model = load_drafter(drafter_dir, target_dir, torch.bfloat16, device)
    graph_batch_sizes = ()
    if fast_path and device.startswith("cuda"):
        model.use_gpu_kernels()
        graph_batch_sizes = tuple(range(1, max_slots + 1))
    return DrafterEngine(model, max_slots, max_len, graph_batch_sizes=graph_batch_sizes)
