"""The DFlash drafter against a naive reference written here from the raw checkpoint tensors.

The reference follows z-lab's `dflash/model.py` (`DFlashDraftModel`, `Qwen3DFlashAttention`,
`_attention_mask`): no cache, context K/V recomputed on every call, masks built from the
absolute positions with explicit loops, plain softmax attention, GQA by repeat_interleave.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_serve.errors import CheckpointError, ConfigError, InvalidRequestError
from drafter_service.engine import DrafterEngine
from drafter_service.model.loader import load_drafter
from drafter_service.speculative_step import DraftRequest, add_context_and_draft
from tests.tiny_checkpoints import TINY_VOCAB, write_dflash

# fp32 throughout. Measured worst gap per variant: 3.5e-6 (reference rule), 5.1e-6 (all causal),
# 3.6e-6 (none causal), 3.8e-6 (all full), 4.6e-6 (all sliding). 5e-5 is ~10x that; a wrong
# mask bit, window off-by-one, relative positions or a `1 + w` norm each fail it by far.
LOGIT_ATOL = 5e-5
# Context chunk sizes per slot: totals 9, 4, 1 and 15 tokens, around the window of 6.
CHUNKS = ((3, 1, 5), (2, 2), (1,), (6, 1, 5, 3))
ANCHORS = (5, 77, 158, 131)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: list[int], theta: float) -> torch.Tensor:
    """NeoX rotate-half over the whole head; x [T, heads, dim]."""
    dim = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    cos, sin = angles.cos().float(), angles.sin().float()
    rotated = torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), dim=-1)
    return x * cos + rotated * sin


def sees(key_pos: int, query_pos: int, causal: bool, window: int | None) -> bool:
    if causal and key_pos > query_pos:
        return False
    if window is not None:
        if query_pos - key_pos >= window:
            return False
        if not causal and key_pos - query_pos >= window:
            return False
    return True


class NaiveDrafter:
    def __init__(self, drafter_dir, target_dir) -> None:
        self.cfg = json.loads((drafter_dir / "config.json").read_text())
        self.w = {k: v.float() for k, v in load_file(drafter_dir / "model.safetensors").items()}
        target = load_file(target_dir / "model.safetensors")
        self.embed = target["model.embed_tokens.weight"].float()  # tied: also the head

    def layer_mask_rule(self, i: int) -> tuple[bool, int | None]:
        kind = self.cfg["layer_types"][i]
        causal = self.cfg.get("is_causal")
        causal = kind == "sliding_attention" if causal is None else bool(causal)
        return causal, self.cfg["sliding_window"] if kind == "sliding_attention" else None

    def logits(self, features: torch.Tensor, anchor: int, num_drafts: int) -> torch.Tensor:
        cfg, w, eps = self.cfg, self.w, self.cfg["rms_norm_eps"]
        heads, kv_heads, dim = (
            cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")
        )
        theta = cfg["rope_theta"]
        mask_id = cfg["dflash_config"]["mask_token_id"]
        context = rms(features.float() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        n, t = context.shape[0], num_drafts + 1
        ctx_pos, blk_pos = list(range(n)), list(range(n, n + t))
        h = self.embed[[anchor] + [mask_id] * num_drafts]  # input_embedding_scale 1
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            x = rms(h, w[p + "input_layernorm.weight"], eps)
            q = (x @ w[p + "self_attn.q_proj.weight"].T).view(t, heads, dim)
            q = rope(rms(q, w[p + "self_attn.q_norm.weight"], eps), blk_pos, theta)
            kv_in = torch.cat((context, x))
            k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(n + t, kv_heads, dim)
            k = rope(rms(k, w[p + "self_attn.k_norm.weight"], eps), ctx_pos + blk_pos, theta)
            v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(n + t, kv_heads, dim)
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
            causal, window = self.layer_mask_rule(i)
            visible = torch.tensor(
                [[sees(kp, qp, causal, window) for kp in ctx_pos + blk_pos] for qp in blk_pos]
            )
            scores = torch.einsum("qhd,khd->hqk", q, k) * dim**-0.5
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            out = torch.einsum("hqk,khd->qhd", probs, v).reshape(t, heads * dim)
            h = h + out @ w[p + "self_attn.o_proj.weight"].T
            x = rms(h, w[p + "post_attention_layernorm.weight"], eps)
            gate = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T)
            h = h + (gate * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return rms(h[1:], w["norm.weight"], eps) @ self.embed.T  # output_multiplier 1


def make_engine(drafter_dir, target_dir, max_slots: int = 4) -> DrafterEngine:
    model = load_drafter(drafter_dir, target_dir, dtype=torch.float32)
    return DrafterEngine(model, max_slots=max_slots, max_len=64)


def features_for(engine: DrafterEngine, num_tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, engine.feature_dim, generator=generator)


def check_against_naive(engine, naive, slots, features, num_drafts) -> float:
    anchors = list(ANCHORS[: len(slots)])
    block = [[a] + [engine.config.mask_token_id] * num_drafts for a in anchors]
    with torch.no_grad():
        got = engine.model.draft_logits(engine.cache, slots, torch.tensor(block))
    drafts = engine.draft(slots, anchors, num_drafts)
    gap = 0.0
    for b, slot in enumerate(slots):
        want = naive.logits(features[slot], anchors[b], num_drafts)
        assert got[b].shape == (num_drafts, TINY_VOCAB)
        torch.testing.assert_close(got[b], want, atol=LOGIT_ATOL, rtol=0)
        gap = max(gap, (got[b] - want).abs().max().item())
        # The engine drafts a full block whatever num_drafts is and keeps its first tokens.
        full_block = naive.logits(features[slot], anchors[b], engine.config.max_drafts)
        want_drafts = full_block[:num_drafts].argmax(-1).tolist()
        assert drafts[b] == want_drafts, f"slot {slot}, {num_drafts} drafts"
    return gap


VARIANTS = {
    "reference_rule": {},
    "all_causal": {"is_causal": True},
    "none_causal": {"is_causal": False},
    "all_full": {"layer_types": ("full_attention", "full_attention")},
    "all_sliding": {"layer_types": ("sliding_attention",) * 3},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafter_matches_naive_reference(variant, tmp_path, dflash_dir, causal_lm_dir):
    drafter_dir = dflash_dir if variant == "reference_rule" else tmp_path / variant
    if variant != "reference_rule":
        write_dflash(drafter_dir, seed=11, **VARIANTS[variant])
    naive = NaiveDrafter(drafter_dir, causal_lm_dir)
    engine = make_engine(drafter_dir, causal_lm_dir)
    slots = [engine.open_sequence() for _ in CHUNKS]
    features = {}
    for slot, chunks in zip(slots, CHUNKS, strict=True):
        parts = [features_for(engine, size, seed=100 * slot + j) for j, size in enumerate(chunks)]
        for part in parts:
            engine.add_context(slot, part)
        features[slot] = torch.cat(parts)
        assert engine.context_length(slot) == sum(chunks)
    gaps = [check_against_naive(engine, naive, slots, features, k) for k in (15, 4, 1)]
    # One slot alone, and a subset in a different order: batching must not change results.
    gaps.append(check_against_naive(engine, naive, [slots[2]], features, 15))
    gaps.append(check_against_naive(engine, naive, [slots[3], slots[0]], features, 7))
    # Drafting leaves no block keys behind: more context after a draft, then draft again.
    extra = features_for(engine, 3, seed=999)
    engine.add_context(slots[1], extra)
    features[slots[1]] = torch.cat((features[slots[1]], extra))
    gaps.append(check_against_naive(engine, naive, slots, features, 15))
    assert max(gaps) < LOGIT_ATOL  # measured: <= 5.1e-6 (see LOGIT_ATOL)


def test_deferred_context_joins_the_next_draft(dflash_dir, causal_lm_dir):
    """A paced-out step's features wait outside the cache (no forward); the next draft adds
    them before its own rows, and drafts what the reference gives on the whole context."""
    naive = NaiveDrafter(dflash_dir, causal_lm_dir)
    engine = make_engine(dflash_dir, causal_lm_dir)
    slots = [engine.open_sequence() for _ in range(2)]
    features, last = {}, {}
    for slot, sizes in zip(slots, ((3, 1, 1, 2), (2, 4, 3)), strict=True):
        parts = [features_for(engine, n, seed=10 * slot + j) for j, n in enumerate(sizes)]
        engine.add_context(slot, parts[0])
        for part in parts[1:-1]:
            engine.defer_context(slot, part)
        assert engine.cache.lengths[slot] == sizes[0]
        assert engine.context_length(slot) == sum(sizes[:-1])
        features[slot], last[slot] = torch.cat(parts), parts[-1]
    anchors = list(ANCHORS[:2])
    drafts = engine.add_context_and_draft(slots, [last[s] for s in slots], anchors, 15)
    for b, slot in enumerate(slots):
        assert engine.cache.lengths[slot] == features[slot].shape[0]
        assert drafts[b] == naive.logits(features[slot], anchors[b], 15).argmax(-1).tolist()
    assert check_against_naive(engine, naive, slots, features, 15) < LOGIT_ATOL


def test_deferred_context_enters_before_a_plain_draft_or_add(dflash_dir, causal_lm_dir):
    """draft() and add_context() add a slot's deferred rows first, in order."""
    naive = NaiveDrafter(dflash_dir, causal_lm_dir)
    engine = make_engine(dflash_dir, causal_lm_dir)
    slot = engine.open_sequence()
    parts = [features_for(engine, n, seed=n) for n in (4, 2, 3, 1)]
    engine.add_context(slot, parts[0])
    engine.defer_context(slot, parts[1])
    want = naive.logits(torch.cat(parts[:2]), ANCHORS[0], 15).argmax(-1).tolist()
    assert engine.draft([slot], [ANCHORS[0]], 15) == [want]
    assert engine.cache.lengths[slot] == 6
    engine.defer_context(slot, parts[2])
    engine.add_context(slot, parts[3])
    assert engine.cache.lengths[slot] == engine.context_length(slot) == 10
    check_against_naive(engine, naive, [slot], {slot: torch.cat(parts)}, 4)


def test_deferred_rows_count_against_max_len_and_go_with_the_slot(dflash_dir, causal_lm_dir):
    engine = make_engine(dflash_dir, causal_lm_dir, max_slots=1)  # max_len 64
    slot = engine.open_sequence()
    engine.add_context(slot, features_for(engine, 60, seed=0))
    engine.defer_context(slot, features_for(engine, 3, seed=1))
    with pytest.raises(InvalidRequestError, match="max_len"):
        engine.defer_context(slot, features_for(engine, 2, seed=2))
    with pytest.raises(InvalidRequestError, match="max_len"):
        engine.add_context_and_draft([slot], [features_for(engine, 0, seed=3)], [5], 1)
    assert engine.context_length(slot) == 63 and engine.cache.lengths[slot] == 60
    engine.close_sequence(slot)
    slot = engine.open_sequence()
    assert engine.context_length(slot) == 0


def test_a_paced_out_request_runs_no_forward(dflash_dir, causal_lm_dir, monkeypatch):
    """speculative_step: num_drafts 0 defers the features; drafting requests still run."""
    engine = make_engine(dflash_dir, causal_lm_dir)
    paced, drafting = engine.open_sequence(), engine.open_sequence()
    for slot in (paced, drafting):
        engine.add_context(slot, features_for(engine, 3, seed=slot))
    forwards = []
    add_context = engine.model.add_context
    monkeypatch.setattr(
        engine.model,
        "add_context",
        lambda cache, slot, rows: forwards.append(slot) or add_context(cache, slot, rows),
    )
    requests = [
        DraftRequest(paced, features_for(engine, 1, seed=7), 5, 0),
        DraftRequest(drafting, features_for(engine, 2, seed=8), 6, 15),
    ]
    results = add_context_and_draft(engine, requests)
    assert results[0].token_ids == [] and len(results[1].token_ids) == 15
    assert forwards == [drafting]
    assert engine.cache.lengths[paced] == 3 and engine.context_length(paced) == 4


def test_reused_slot_starts_empty(dflash_dir, causal_lm_dir):
    naive = NaiveDrafter(dflash_dir, causal_lm_dir)
    engine = make_engine(dflash_dir, causal_lm_dir, max_slots=1)
    slot = engine.open_sequence()
    engine.add_context(slot, features_for(engine, 8, seed=1))
    engine.close_sequence(slot)
    slot = engine.open_sequence()
    fresh = features_for(engine, 5, seed=2)
    engine.add_context(slot, fresh)
    check_against_naive(engine, naive, [slot], {slot: fresh}, 15)


def test_zlab_checkpoint_loads(dflash_dir, causal_lm_dir):
    model = load_drafter(dflash_dir, causal_lm_dir, dtype=torch.float32)
    config = model.config
    assert config.target_layer_ids == (0, 2, 4)
    assert config.mask_token_id == TINY_VOCAB - 2
    assert config.layer_types == ("sliding_attention", "full_attention")
    assert config.sliding_window == 6 and config.block_size == 16 and config.max_drafts == 15
    assert config.is_causal is None
    assert [config.layer_is_causal(i) for i in range(2)] == [True, False]
    raw = load_file(dflash_dir / "model.safetensors")
    params = dict(model.named_parameters())
    assert set(params) == set(raw)
    for name, tensor in raw.items():
        assert params[name].dtype == torch.float32
        assert torch.equal(params[name], tensor.float()), name
    embed = load_file(causal_lm_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.embed_weight, embed.float())
    assert torch.equal(model.head_weight, embed.float())


def test_model_prefixed_checkpoint_loads(tmp_path, dflash_dir, causal_lm_dir):
    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    raw = load_file(dflash_dir / "model.safetensors")
    save_file({"model." + k: v for k, v in raw.items()}, prefixed / "model.safetensors")
    (prefixed / "config.json").write_text((dflash_dir / "config.json").read_text())
    model = load_drafter(prefixed, causal_lm_dir, dtype=torch.float32)
    assert torch.equal(model.fc.weight, raw["fc.weight"].float())


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"hidden_size": 32}, "hidden_size"),
        ({"target_layer_ids": (0, 9)}, "target_layer_ids"),
        ({"mask_token_id": 10_000}, "mask_token_id"),
        ({"mask_token_id": -1}, "mask_token_id"),
    ],
)
def test_drafter_that_does_not_fit_target(fields, named, tmp_path, causal_lm_dir):
    drafter_dir = write_dflash(tmp_path / "bad", **fields)
    with pytest.raises(ConfigError, match=named):
        load_drafter(drafter_dir, causal_lm_dir)


@pytest.mark.parametrize("removed", ["layers.1.self_attn.k_norm.weight", "layers.0.mlp.up_proj"])
def test_missing_tensor_is_named(removed, tmp_path, dflash_dir, causal_lm_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    raw = load_file(dflash_dir / "model.safetensors")
    name = removed if removed.endswith(".weight") else removed + ".weight"
    del raw[name]
    save_file(raw, broken / "model.safetensors")
    (broken / "config.json").write_text((dflash_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match=removed.replace(".", r"\.")):
        load_drafter(broken, causal_lm_dir)


@pytest.fixture
def engine(dflash_dir, causal_lm_dir):
    return make_engine(dflash_dir, causal_lm_dir, max_slots=2)


def test_engine_rejects_bad_features(engine):
    slot = engine.open_sequence()
    for bad in (
        torch.zeros(2, engine.feature_dim - 1),
        torch.zeros(2, 48),
        torch.zeros(engine.feature_dim),
        torch.zeros(1, 2, engine.feature_dim),
    ):
        with pytest.raises(InvalidRequestError, match="features"):
            engine.add_context(slot, bad)
    assert engine.context_length(slot) == 0


@pytest.mark.parametrize("num_drafts", [0, 16, -1])
def test_engine_rejects_num_drafts_out_of_range(engine, num_drafts):
    slot = engine.open_sequence()
    engine.add_context(slot, features_for(engine, 3, seed=0))
    with pytest.raises(InvalidRequestError, match="num_drafts"):
        engine.draft([slot], [5], num_drafts)


@pytest.mark.parametrize("anchor", [-1, TINY_VOCAB, 10_000])
def test_engine_rejects_anchor_outside_vocabulary(engine, anchor):
    slot = engine.open_sequence()
    engine.add_context(slot, features_for(engine, 3, seed=0))
    with pytest.raises(InvalidRequestError, match="anchor"):
        engine.draft([slot], [anchor], 4)


def test_engine_rejects_closed_slot_and_mismatched_anchors(engine):
    slot = engine.open_sequence()
    engine.add_context(slot, features_for(engine, 3, seed=0))
    with pytest.raises(InvalidRequestError):
        engine.draft([slot], [1, 2], 4)
    with pytest.raises(InvalidRequestError):
        engine.draft([slot + 1], [1], 4)
