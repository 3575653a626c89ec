"""How far following the text alone gets on held-out prompts: a diagnostic for the drafter.

The embedded target, asked about something it was not trained on, mostly recites its
training answers. This measures that, and the acceptance a drafter that only follows the
text would get: a lookup drafter proposes, at each served step, the 15 tokens that followed
the longest suffix (up to 12 tokens) of the answer so far in the target's own answers to
the training questions (the drafter's training labels), walked as the served loop walks
(`drafter_eval.walk_accepted`). Beside it, the DFlash drafter's served-equivalent τ on the
same generations. Not a serving component: the gap between the two says how much a DFlash
drafter could gain by following the text better.

    python -m training.lookup_ceiling --generations pair/generations.json [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from bench.timing import run_facts
from drafter_service.model.loader import load_drafter
from launcher.embedded_default import EMBEDDED_DIR
from target_service.model.loader import load_target_model
from training.drafter_eval import walk_accepted, walk_result, walk_steps
from training.generate import generate_greedy
from training.generation_cache import target_digest

SUFFIX_LENGTHS = (12, 8, 6, 4, 3, 2, 1)
NUM_DRAFTS = 15


class SuffixLookup:
    """First occurrence of every n-gram (n in SUFFIX_LENGTHS) of the answers, by position of
    the token after it; answers are separated so that no n-gram spans two."""

    def __init__(self, answers: list[list[int]]) -> None:
        self.tokens: list[int] = []
        for answer in answers:
            self.tokens += [*answer, -1]
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in SUFFIX_LENGTHS}
        for n, table in self.after.items():
            for end in range(n, len(self.tokens)):
                gram = tuple(self.tokens[end - n : end])
                if -1 not in gram:
                    table.setdefault(gram, end)

    def correct_drafts(self, text: list[int], following: list[int]) -> int:
        """How many of `following` the lookup's drafts after `text` get right in a row."""
        for n in SUFFIX_LENGTHS:
            start = self.after[n].get(tuple(text[-n:])) if len(text) >= n else None
            if start is not None:
                count = 0
                while count < len(following) and self.tokens[start + count] == following[count]:
                    count += 1
                return count
        return 0


def lookup_walks(lookup: SuffixLookup, answers, max_new_tokens, eos_ids) -> list[list[int]]:
    """The lookup's accepted drafts per served step, for each answer."""
    walks = []
    for answer in answers:
        correct = [
            lookup.correct_drafts(answer[: i + 1], answer[i + 1 : i + 1 + NUM_DRAFTS])
            for i in range(len(answer))
        ]
        walk = walk_accepted(correct, answer, max_new_tokens, NUM_DRAFTS, eos_ids)
        walks.append(walk if len(answer) >= 2 else [])
    return walks


def lookup_tau(lookup: SuffixLookup, answers, max_new_tokens, eos_ids) -> tuple[float, int]:
    steps = [kept for walk in lookup_walks(lookup, answers, max_new_tokens, eos_ids)
             for kept in walk]  # fmt: skip
    return 1 + sum(steps) / max(len(steps), 1), len(steps)


def recited_share(lookup: SuffixLookup, answers, n: int = 8) -> float:
    """Fraction of answer tokens (past the first n) that follow their preceding n tokens as
    they do at that n-gram's first occurrence in the training answers."""
    hits = total = 0
    for answer in answers:
        for i in range(n, len(answer)):
            start = lookup.after[n].get(tuple(answer[i - n : i]))
            total += 1
            hits += start is not None and lookup.tokens[start] == answer[i]
    return hits / max(total, 1)


def is_recital(answer: list[int], training_answers: list[list[int]], share: float = 0.9) -> bool:
    """Whether at least `share` of the answer is the start of one training answer."""
    need = share * len(answer)
    for other in training_answers:
        same = 0
        for mine, theirs in zip(answer, other, strict=False):
            if mine != theirs:
                break
            same += 1
        if same >= need:
            return True
    return False


def summary(lookup, answers, lookup_by_answer, dflash_by_answer) -> dict:
    """Both drafters' served-equivalent τ over some answers (their walks, answer by answer),
    and the recited share."""
    lookup_steps = [kept for walk in lookup_by_answer for kept in walk]
    dflash = walk_result([kept for walk in dflash_by_answer for kept in walk], NUM_DRAFTS)
    return {
        "num_prompts": len(answers),
        "tau_lookup": round(1 + sum(lookup_steps) / max(len(lookup_steps), 1), 3),
        "lookup_steps": len(lookup_steps),
        "tau_dflash": dflash.tau,
        "dflash_steps": dflash.num_steps,
        "dflash_accept_per_position": dflash.accept_per_position,
        "recited_share_after_8_tokens": round(recited_share(lookup, answers), 3),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=EMBEDDED_DIR / "target")
    parser.add_argument("--drafter", type=Path, default=EMBEDDED_DIR / "drafter")
    parser.add_argument(
        "--generations",
        type=Path,
        required=True,
        help="the target's answers to the training questions, as training.embedded_pair "
        "writes them (its --generations file)",
    )
    parser.add_argument("--prompts", type=Path, default=EMBEDDED_DIR / "held_out_prompts.json")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--commit")
    args = parser.parse_args(argv)

    saved = json.loads(args.generations.read_text())
    if saved.get("target_sha256") != target_digest(args.target):
        raise SystemExit(f"{args.generations} holds another target's answers than {args.target}")
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    eos_ids = json.loads((args.target / "config.json").read_text())["eos_token_id"]
    texts = json.loads(args.prompts.read_text())[: args.num_prompts]
    prompts = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    target = load_target_model(args.target, torch.float32, "cpu").eval()
    answers = generate_greedy(target, prompts, args.max_new_tokens, eos_ids, log=lambda _: None)

    lookup = SuffixLookup(saved["answers"])
    drafter = load_drafter(args.drafter, args.target, torch.float32, "cpu").eval()
    pairs = list(zip(prompts, answers, strict=True))
    recital = [is_recital(answer, saved["answers"]) for answer in answers]
    argv = sys.argv[1:] if argv is None else argv
    record = run_facts("python -m training.lookup_ceiling " + " ".join(argv))
    record |= {
        "commit": args.commit or record["commit"],
        "prompts": str(args.prompts),
        "max_new_tokens": args.max_new_tokens,
        "generations": f"{args.generations} ({saved.get('numerics')}, "
        f"{len(saved['answers'])} answers, {len(lookup.tokens)} tokens)",
    }
    # Each drafter walks every answer once; the groups take their answers' walks.
    by_lookup = lookup_walks(lookup, answers, args.max_new_tokens, eos_ids)
    by_dflash = walk_steps(drafter, target, pairs, args.max_new_tokens, eos_ids)
    record |= summary(lookup, answers, by_lookup, by_dflash)
    # Answers that are (>= 90 %) one training answer's start, and the others.
    for name, keep in (("recited_answers", True), ("other_answers", False)):
        picked = [i for i, is_one in enumerate(recital) if is_one == keep]
        record[name] = summary(
            lookup,
            [answers[i] for i in picked],
            [by_lookup[i] for i in picked],
            [by_dflash[i] for i in picked],
        )
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
