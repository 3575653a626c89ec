"""The training corpus and tokenizer against independent oracles.

The docstrings are checked against `inspect.getdoc` of the imported object, the chat rendering
against the chat template as transformers' AutoTokenizer applies it from a written directory.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import textwrap

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer

from dflash_serve.checkpoint.byte_tokenizer import ALL_SPECIAL_TOKENS, SPECIAL_TOKENS
from training.corpus import (
    GROUNDED_CHARS,
    GROUNDED_PREFIX,
    MAX_ANSWER_CHARS,
    MIN_ANSWER_CHARS,
    SKIPPED_DIRS,
    SOURCE_PREFIX,
    WORD,
    build_corpus,
    cap_text,
    collect_documentation,
    is_held_out,
    is_validation,
    load_corpus,
    load_documentation,
    prompt_text,
    render_chat,
    save_corpus,
    save_documentation,
    stdlib_dir,
    subject_of,
)
from training.corpus import main as corpus_main
from training.tokenizer import train_tokenizer, write_tokenizer

NON_ASCII = "naïve — 日本語 🙂 Ünïcödé\tnull\x00 end"


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(seed=0)


@pytest.fixture(scope="module")
def conversations(corpus):
    return {c.name: c for c in (*corpus.train, *corpus.held_out)}


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_tokenizer(render_chat(c) for c in corpus.train)


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("trained_tokenizer")
    return model_dir, write_tokenizer(tokenizer, model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir[0])


def test_corpus_is_deterministic(corpus):
    assert build_corpus(seed=0) == corpus


def test_split_depends_on_names_only(corpus):
    subset = build_corpus(seed=1, modules={"json", "textwrap"})
    assert {c.name for c in subset.held_out} <= {c.name for c in corpus.held_out}
    assert {c.name for c in subset.train} <= {c.name for c in corpus.train}
    by_name = {c.name: c for c in corpus.train}
    questions_changed = [c for c in subset.train if c.question != by_name[c.name].question]
    assert questions_changed, "seed 1 chose the same question template for every item"


def test_held_out_is_disjoint_and_about_three_percent(corpus):
    train_names = [c.name for c in corpus.train]
    held_out_names = [c.name for c in corpus.held_out]
    assert len(set(train_names)) == len(train_names)
    assert set(train_names).isdisjoint(held_out_names)
    assert 0.01 < len(held_out_names) / (len(train_names) + len(held_out_names)) < 0.06


def test_known_docstrings_match_the_imported_objects(conversations):
    dedent = conversations["textwrap.dedent"]
    assert "`textwrap.dedent`" in dedent.question
    assert dedent.answer == inspect.getdoc(textwrap.dedent)
    decode = conversations["json.decoder.JSONDecoder.decode"]
    assert decode.answer == inspect.getdoc(json.JSONDecoder.decode)
    assert "module" in conversations["json"].question
    assert conversations["topic:assert"].answer.startswith('The "assert" statement')
    assert "`assert`" in conversations["topic:assert"].question


def test_skips_private_test_and_short_items(conversations, corpus):
    for name, conversation in conversations.items():
        parts = name.removeprefix("topic:").split(".")
        assert not any(part.startswith("_") for part in parts), name
        assert SKIPPED_DIRS.isdisjoint(parts[:-1]), name
        assert MIN_ANSWER_CHARS <= len(conversation.answer) <= MAX_ANSWER_CHARS, name
    assert "unittest.test" not in conversations
    assert "idlelib.idle_test" not in conversations
    assert "CPython 3." in corpus.source and "PSF-2.0" in corpus.source


@pytest.fixture(scope="module")
def with_sources():
    return build_corpus(seed=0, modules={"json", "textwrap", "asyncio"}, sources=True)


def test_source_conversations_hold_the_functions_code(with_sources):
    by_name = {c.name: c for c in (*with_sources.train, *with_sources.held_out)}
    fill = by_name["source:textwrap.fill"]
    assert "`textwrap.fill`" in fill.question
    assert fill.answer == textwrap.dedent(inspect.getsource(textwrap.fill)).strip()
    assert "source:textwrap.dedent" not in by_name  # longer than MAX_ANSWER_CHARS
    encode = by_name["source:json.encoder.JSONEncoder.encode"]
    assert encode.answer == textwrap.dedent(inspect.getsource(json.JSONEncoder.encode)).strip()
    sources = [c for c in by_name.values() if c.name.startswith(SOURCE_PREFIX)]
    assert len(sources) > 100
    for conversation in sources:
        parts = conversation.name.removeprefix(SOURCE_PREFIX).split(".")
        assert not any(part.startswith("_") for part in parts), conversation.name
        assert MIN_ANSWER_CHARS <= len(conversation.answer) <= MAX_ANSWER_CHARS
        assert conversation.answer.startswith(("def ", "async def ")), conversation.name
    assert "source code" in with_sources.source


def test_a_source_is_held_out_with_its_docstring(with_sources, corpus):
    held_out = {c.name for c in with_sources.held_out}
    sources = [c.name for c in (*with_sources.train, *with_sources.held_out)
               if c.name.startswith(SOURCE_PREFIX)]  # fmt: skip
    held_sources = [name for name in sources if name in held_out]
    assert held_sources, "no source conversation held out in these modules"
    for name in sources:
        assert (name in held_out) == is_held_out(name.removeprefix(SOURCE_PREFIX)), name
    # Adding sources leaves the docstring conversations and their split as they were.
    documented = build_corpus(seed=0, modules={"json", "textwrap", "asyncio"})
    assert [c for c in with_sources.train if not c.name.startswith(SOURCE_PREFIX)] == list(
        documented.train
    )
    assert [c for c in with_sources.held_out if not c.name.startswith(SOURCE_PREFIX)] == list(
        documented.held_out
    )


MODULES = {"json", "textwrap", "asyncio"}


@pytest.fixture(scope="module")
def grounded():
    return build_corpus(seed=0, modules=MODULES, grounded=2)


def quoted_entries(question: str) -> dict[str, str]:
    """A grounded prompt parsed independently: heading name → the text under it."""
    body, _, _ = question.rpartition("\n\n")
    parts = re.split(r"(?:^|\n\n)### `([^`]+)`\n", body)
    assert parts[0] == "", question[:80]
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def words_in_place(words: list[str], originals: list[list[str]]) -> list[int]:
    """For each original of the same word count, how many of `words` equal its word in
    the same place (how much of a documented text survived the swaps)."""
    return [
        sum(a == b for a, b in zip(words, original, strict=True))
        for original in originals
        if len(original) == len(words)
    ]


def test_grounded_answers_are_the_text_under_the_asked_heading(grounded):
    conversations = [c for c in (*grounded.train, *grounded.held_out)
                     if c.name.startswith(GROUNDED_PREFIX)]  # fmt: skip
    assert len(conversations) > 400
    for conversation in conversations:
        asked = conversation.name.removeprefix(GROUNDED_PREFIX).partition("#")[0]
        assert subject_of(conversation) == asked
        entries = quoted_entries(conversation.question)
        assert asked in entries and 1 <= len(entries) <= 4, conversation.name
        assert entries[asked] == conversation.answer
        assert len(set(entries.values())) == len(entries)  # no ambiguous answer
        assert all(len(text) <= GROUNDED_CHARS for text in entries.values())
        siblings = {name.rpartition(".")[0] for name in entries}
        assert siblings == {asked.rpartition(".")[0]}, conversation.name


def test_held_out_grounded_prompts_quote_real_documentation_and_training_ones_no_held_out_text(
    grounded,
):
    plain = build_corpus(seed=0, modules=MODULES)
    documentation = {c.name: c.answer for c in (*plain.train, *plain.held_out)}
    held_out_texts = {cap_text(documentation[c.name], GROUNDED_CHARS) for c in plain.held_out}
    held = [c for c in grounded.held_out if c.name.startswith(GROUNDED_PREFIX)]
    assert held and all("#" not in c.name for c in held)  # one variant each
    for conversation in held:
        for name, text in quoted_entries(conversation.question).items():
            assert text == cap_text(documentation[name], GROUNDED_CHARS), name
    trained = [c for c in grounded.train if c.name.startswith(GROUNDED_PREFIX)]
    names = {c.name.partition("#")[0] for c in trained}
    assert len(trained) == 2 * len(names)  # two variants per training object
    relabelled = 0
    for conversation in trained:
        entries = quoted_entries(conversation.question)
        assert held_out_texts.isdisjoint(entries.values()), conversation.name
        relabelled += sum(
            text != cap_text(documentation.get(name, ""), GROUNDED_CHARS)
            for name, text in entries.items()
        )
    num_entries = sum(len(quoted_entries(c.question)) for c in trained)
    assert relabelled > 0.9 * num_entries
    # Words swapped: no entry is a documented text, and about a fifth of the words differ
    # from the text of equal word count it most resembles (drawn from a training object).
    known = {cap_text(text, GROUNDED_CHARS) for text in documentation.values()}
    entries = [text for c in trained for text in quoted_entries(c.question).values()]
    assert sum(text in known for text in entries) < 0.01 * len(entries)
    originals = [WORD.findall(text) for text in known]
    sample = entries[:: max(1, len(entries) // 40)]
    fractions = []
    for text in sample:
        swapped = WORD.findall(text)
        same = max(words_in_place(swapped, originals))
        fractions.append(1 - same / len(swapped))
    assert 0.1 < sum(fractions) / len(fractions) < 0.3
    # The closed-book conversations and their split are as without grounded ones.
    assert [c for c in grounded.train if not c.name.startswith(GROUNDED_PREFIX)] == list(
        plain.train
    )
    assert "quoted in the prompt" in grounded.source


def test_swapped_words_sets_the_fraction_of_training_words_replaced():
    """--swapped-words 1: every word of a grounded training text is a random corpus word
    (word salad no model can recall), the held-out prompts stay real documentation."""
    salad = build_corpus(seed=0, modules=MODULES, grounded=1, swapped_words=1.0)
    plain = build_corpus(seed=0, modules=MODULES, grounded=1)
    documentation = {c.name: c.answer for c in (*plain.train, *plain.held_out)}
    originals = [WORD.findall(cap_text(text, GROUNDED_CHARS)) for text in documentation.values()]
    trained = [c for c in salad.train if c.name.startswith(GROUNDED_PREFIX)]
    assert [c.name for c in trained] == [
        c.name for c in plain.train if c.name.startswith(GROUNDED_PREFIX)
    ]
    kept = total = 0
    for conversation in trained[::10]:
        for text in quoted_entries(conversation.question).values():
            words = WORD.findall(text)
            same = max(words_in_place(words, originals), default=0)
            kept, total = kept + same, total + len(words)
    assert total > 1000 and kept < 0.05 * total
    assert salad.held_out == plain.held_out


def test_the_validation_split_is_part_of_training_and_about_three_percent(corpus):
    chosen = [c.name for c in corpus.train if is_validation(c.name)]
    assert 0.01 < len(chosen) / len(corpus.train) < 0.06
    held_out = [c.name for c in corpus.held_out if is_validation(c.name)]
    assert len(held_out) < len(corpus.held_out)  # another hash than the held-out split


def test_cap_text_cuts_at_the_last_boundary_that_keeps_half():
    paragraphs = "first paragraph line\nsecond line\n\nnext paragraph words words"
    assert cap_text(paragraphs, 40) == "first paragraph line\nsecond line"
    assert cap_text("one line\n" + "word " * 20, 40) == "one line\n" + "word " * 5 + "word"
    assert cap_text("x" * 50, 40) == "x" * 40
    assert cap_text("short", 40) == "short"


def test_a_documentation_file_builds_the_same_corpus_elsewhere(grounded, tmp_path):
    """What the GPU machine does: build the corpus from documentation another interpreter
    read (--documentation), recording that interpreter's version, not its own."""
    documentation = tmp_path / "docs.json"
    save_documentation(collect_documentation(stdlib_dir(), MODULES), documentation, "3.99.1")
    out = tmp_path / "corpus.json"
    corpus_main(["--documentation", str(documentation), "--out", str(out), "--grounded", "2"])
    built = load_corpus(out)
    assert built.train == grounded.train and built.held_out == grounded.held_out
    assert built.source.startswith("CPython 3.99.1 standard library docstrings")
    assert built.source.removeprefix("CPython 3.99.1") == grounded.source.removeprefix(
        "CPython " + ".".join(map(str, sys.version_info[:3]))
    )
    again = tmp_path / "again.json"
    corpus_main(["--documentation", str(documentation), "--documentation-out", str(again),
                 "--out", str(tmp_path / "c2.json")])  # fmt: skip
    assert load_documentation(again)[1] == "3.99.1"


def test_save_and_load_round_trip(corpus, tmp_path):
    path = tmp_path / "corpus.json"
    save_corpus(corpus, path)
    assert load_corpus(path) == corpus


def test_render_chat_is_the_chat_template_plus_answer(corpus, hf_tokenizer):
    for conversation in (*corpus.train[:20], *corpus.held_out[:5]):
        prompt = hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": conversation.question}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        assert prompt_text(conversation.question) == prompt
        assert render_chat(conversation) == prompt + conversation.answer + "<|im_end|>\n"


def test_tokenizer_round_trips_any_text(corpus, tokenizer, hf_tokenizer):
    samples = [render_chat(c) for c in corpus.train[::100]] + [NON_ASCII]
    for text in samples:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        hf_ids = hf_tokenizer.encode(text, add_special_tokens=False)
        assert hf_ids == ids
        assert hf_tokenizer.decode(hf_ids, skip_special_tokens=False) == text


def test_special_tokens_have_fixed_single_ids(tokenizer, tokenizer_dir, hf_tokenizer):
    _, special_ids = tokenizer_dir
    assert special_ids == {name: i for i, name in enumerate(ALL_SPECIAL_TOKENS)}
    for name, token_id in special_ids.items():
        assert tokenizer.encode(name).ids == [token_id]
        assert hf_tokenizer.convert_tokens_to_ids(name) == token_id
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.pad_token == "<|endoftext|>"


def test_tokenizer_vocab_layout_and_determinism(corpus, tokenizer):
    assert tokenizer.get_vocab_size() == 4096
    num_specials = len(ALL_SPECIAL_TOKENS)
    byte_symbols = {tokenizer.id_to_token(i) for i in range(num_specials, num_specials + 256)}
    assert byte_symbols == set(pre_tokenizers.ByteLevel.alphabet())
    learned = [tokenizer.id_to_token(i) for i in range(num_specials + 256, 4096)]
    assert not any("<|" in token or "think>" in token for token in learned)
    again = train_tokenizer(render_chat(c) for c in corpus.train)
    assert again.to_str() == tokenizer.to_str()


def test_tokenizer_compresses_held_out_text(corpus, tokenizer):
    texts = [render_chat(c) for c in corpus.held_out]
    num_bytes = sum(len(text.encode("utf-8")) for text in texts)
    num_tokens = sum(len(encoding.ids) for encoding in tokenizer.encode_batch(texts))
    assert num_tokens / num_bytes < 0.45


def test_write_tokenizer_names_missing_special_tokens(tmp_path):
    without_mask = Tokenizer(models.BPE())
    without_mask.add_special_tokens(list(SPECIAL_TOKENS))
    with pytest.raises(ValueError, match=re.escape(repr(["<|mask|>"]))):
        write_tokenizer(without_mask, tmp_path)


def test_invented_questions_ask_about_subjects_that_do_not_exist(corpus):
    import random

    from training.corpus import OBJECT_QUESTIONS, invented_question, subject_of

    known = {subject_of(c) for c in (*corpus.train, *corpus.held_out)}
    first = [invented_question(corpus.train, random.Random(3), known) for _ in range(1)]
    rng = random.Random(3)
    questions = [invented_question(corpus.train, rng, known) for _ in range(200)]
    assert questions[0] == first[0]  # seeded: reproducible
    for question in questions:
        subject = question.split("`")[1]
        assert subject not in known
        assert any(t.format(subject) == question for t in OBJECT_QUESTIONS)
