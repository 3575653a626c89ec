"""A byte-level tokenizer with Qwen's special tokens and a ChatML template, written to disk.

The embedded default model and the tests need a real tokenizer that transformers'
AutoTokenizer loads from a checkpoint directory. Every byte is one token (ids 0..255), so
any text round-trips and multi-byte characters span several tokens — exactly the case
incremental detokenization must get right.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
NUM_BYTE_TOKENS = 256
# Ids after the special tokens: the drafter's MASK placeholder, never produced by the text.
MASK_TOKEN = "<|mask|>"
ALL_SPECIAL_TOKENS = (*SPECIAL_TOKENS, MASK_TOKEN)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{ '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
# For models that never learned to think (the trained embedded pair): the generation prompt
# always closes an empty think block, as CHAT_TEMPLATE does with enable_thinking=False.
NO_THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- if enable_thinking is defined and not enable_thinking %}", "{%- if true %}"
)


def special_token_ids() -> dict[str, int]:
    return {name: NUM_BYTE_TOKENS + i for i, name in enumerate(ALL_SPECIAL_TOKENS)}


def write_byte_tokenizer(model_dir: Path) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja; return special ids."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_symbols = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(ALL_SPECIAL_TOKENS))
    specials = write_tokenizer_files(tokenizer, model_dir)
    assert specials == special_token_ids(), specials
    return specials


def special_ids_in(tokenizer: Tokenizer) -> dict[str, int | None]:
    """The id of each token in ALL_SPECIAL_TOKENS in any tokenizer (None where it lacks
    one); `special_token_ids` gives the byte-level tokenizer's fixed ones."""
    return {name: tokenizer.token_to_id(name) for name in ALL_SPECIAL_TOKENS}


def write_tokenizer_files(
    tokenizer: Tokenizer, model_dir: Path, chat_template: str = CHAT_TEMPLATE
) -> dict[str, int]:
    """Write any tokenizer with our special tokens as an AutoTokenizer-loadable directory.

    Writes tokenizer.json, tokenizer_config.json and chat_template.jinja into model_dir and
    returns the id of each token in ALL_SPECIAL_TOKENS.
    """
    specials = special_ids_in(tokenizer)
    missing = [name for name, token_id in specials.items() if token_id is None]
    if missing:
        raise ValueError(f"tokenizer must contain all of {ALL_SPECIAL_TOKENS}, but lacks {missing}")
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "TokenizersBackend",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": False,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (model_dir / "chat_template.jinja").write_text(chat_template)
    return specials


def _byte_of(symbol: str) -> int:
    """The byte a GPT-2 byte-level symbol stands for (the inverse of bytes_to_unicode)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    if ord(symbol) in printable:
        return ord(symbol)
    others = [b for b in range(256) if b not in printable]
    return others[ord(symbol) - 256]
