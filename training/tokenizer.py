"""A byte-level BPE tokenizer trained on the chat corpus, written like the serving byte tokenizer.

The special tokens take the first ids (in ALL_SPECIAL_TOKENS order), the 256 byte symbols
follow, then the learned merges; every byte has a token, so any text round-trips.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dflash_serve.checkpoint.byte_tokenizer import (
    ALL_SPECIAL_TOKENS,
    NO_THINKING_CHAT_TEMPLATE,
    write_tokenizer_files,
)

NUM_BYTE_TOKENS = 256


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly vocab_size tokens (if the texts allow that many
    merges) learned from texts; the same texts give the same tokenizer."""
    min_vocab_size = len(ALL_SPECIAL_TOKENS) + NUM_BYTE_TOKENS
    if vocab_size < min_vocab_size:
        raise ValueError(f"vocab_size must be at least {min_vocab_size}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(ALL_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_without_special_tokens(texts), trainer=trainer)
    return tokenizer


def write_tokenizer(tokenizer: Tokenizer, model_dir: Path) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja; return special ids.

    The trained models answer without thinking, so their template always closes an empty
    think block (the prompts they were trained on)."""
    return write_tokenizer_files(tokenizer, model_dir, NO_THINKING_CHAT_TEMPLATE)


def _without_special_tokens(texts: Iterable[str]) -> Iterator[str]:
    """The pieces of each text between special tokens, so no merge spans or builds one."""
    for text in texts:
        pieces = [text]
        for special in ALL_SPECIAL_TOKENS:
            pieces = [part for piece in pieces for part in piece.split(special)]
        yield from (piece for piece in pieces if piece)


def conversation_ids(tokenizer: Tokenizer, prompt: str, answer: str) -> list[int]:
    """Token ids of one training conversation, as serving sees them: the prompt encoded on
    its own (as the chat template's output is), then the answer and `<|im_end|>\\n`.

    Encoding the joined text instead merges across the boundary (the prompt's closing
    "\\n\\n" splits differently before a word), so a model trained on it never sees the
    prompt tokens it is served and starts every answer wrong.
    """
    return conversation_ids_with_answer_start(tokenizer, prompt, answer)[0]


def conversation_ids_with_answer_start(
    tokenizer: Tokenizer, prompt: str, answer: str
) -> tuple[list[int], int]:
    """conversation_ids and the index of the answer's first token (the prompt's length),
    for a loss or an accuracy over the answer only."""
    prompt_ids = tokenizer.encode(prompt).ids
    return prompt_ids + tokenizer.encode(answer + "<|im_end|>\n").ids, len(prompt_ids)
