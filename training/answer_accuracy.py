"""How many of the target's greedy answers are exactly right, by kind of question.

Acceptance length cannot tell a target that recalls or reads its answers from one that
only sounds right: fluent wrong text is as easy to draft as true text. This count can.
Groups: closed-book and grounded (documentation quoted in the prompt) questions, held out
and from training; a right answer is the reference text exactly (surrounding whitespace
aside), greedy, within `max_new_tokens`. Since one wrong token makes a whole answer wrong,
each group also gets its token accuracy: the fraction of reference tokens (and the closing
`<|im_end|>`) the target predicts given the reference before them, which shows a target
learning to copy from its prompt long before its answers come out whole.

    python -m training.answer_accuracy --target DIR --corpus corpus.json [--count 48]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from dflash_serve.checkpoint.byte_tokenizer import special_ids_in
from training.corpus import Conversation, Corpus, is_grounded, load_corpus, prompt_text
from training.generate import generate_greedy, load_generating_target
from training.target_lm import forward_rows
from training.tokenizer import conversation_ids_with_answer_start


def answer_groups(corpus: Corpus, count: int) -> dict[str, list[Conversation]]:
    """Up to `count` conversations of each non-empty group; training ones taken at an even
    stride through the corpus, so that they span its modules."""

    def spread(conversations: list[Conversation]) -> list[Conversation]:
        return conversations[:: max(1, len(conversations) // count)][:count]

    groups = {
        "held_out": [c for c in corpus.held_out if not is_grounded(c)][:count],
        "held_out_grounded": [c for c in corpus.held_out if is_grounded(c)][:count],
        "training": spread([c for c in corpus.train if not is_grounded(c)]),
        "training_grounded": spread([c for c in corpus.train if is_grounded(c)]),
    }
    return {name: group for name, group in groups.items() if group}


def count_right(
    target,
    tokenizer: Tokenizer,
    groups: dict[str, list[Conversation]],
    eos_ids: list[int],
    max_new_tokens: int,
    log=print,
) -> dict[str, dict[str, int]]:
    """{group: {"right": n, "of": size, "token_accuracy": a}} for the target's greedy
    answers and its predictions of the reference tokens."""
    result = {}
    for name, conversations in groups.items():
        prompts = [tokenizer.encode(prompt_text(c.question)).ids for c in conversations]
        answers = generate_greedy(target, prompts, max_new_tokens, eos_ids, log=lambda _: None)
        right = sum(
            tokenizer.decode([t for t in answer if t not in eos_ids]).strip() == c.answer.strip()
            for c, answer in zip(conversations, answers, strict=True)
        )
        accuracy = round(token_accuracy(target, tokenizer, conversations), 4)
        result[name] = {"right": right, "of": len(conversations), "token_accuracy": accuracy}
        log(f"  {name}: {right} of {len(conversations)} answers right, tokens {accuracy:.3f}")
    return result


def token_accuracy(target, tokenizer: Tokenizer, conversations: list[Conversation]) -> float:
    """The fraction of the answers' tokens (as trained: answer, `<|im_end|>`, newline
    excluded) whose greedy prediction from the reference prefix is that token."""
    rows = []
    for conversation in conversations:
        prompt = prompt_text(conversation.question)
        ids, first = conversation_ids_with_answer_start(tokenizer, prompt, conversation.answer)
        rows.append((ids[:-1], first))  # the newline dropped
    return continuation_accuracy(target, rows)


@torch.inference_mode()
def continuation_accuracy(target, rows: list[tuple[list[int], int]]) -> float:
    """Over rows (ids, first): the fraction of ids[first:] whose greedy prediction from the
    ids before it is that token."""
    device = target.embed_tokens.weight.device
    correct = total = 0
    for ids, first in rows:
        logits, _ = forward_rows(target, torch.tensor([ids[:-1]], device=device))
        predicted = logits[0, first - 1 :].argmax(-1).tolist()
        correct += sum(p == t for p, t in zip(predicted, ids[first:], strict=True))
        total += len(ids) - first
    return correct / total


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True, help="target dir with tokenizer")
    parser.add_argument(
        "--corpus", type=Path, required=True, help="corpus the target was trained on"
    )
    parser.add_argument("--count", type=int, default=48, help="questions per group")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    target = load_generating_target(args.target, args.device)
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    specials = special_ids_in(tokenizer)
    eos_ids = [specials["<|im_end|>"], specials["<|endoftext|>"]]
    groups = answer_groups(load_corpus(args.corpus), args.count)
    result = count_right(target, tokenizer, groups, eos_ids, args.max_new_tokens)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
