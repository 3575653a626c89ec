"""Train the embedded default pair end to end: corpus → tokenizer → target → drafter.

    python -m training.embedded_pair --out-dir DIR --device cuda [--corpus corpus.json]

Writes DIR/target (Hugging Face layout with tokenizer and chat template), DIR/drafter (z-lab
DFlash layout), DIR/held_out_prompts.json (chat prompts of held-out items, for
`bench.embedded`; with a grounded corpus the grounded ones, and the closed-book ones in
DIR/held_out_closed_book_prompts.json) and DIR/training_log.json (settings, step counts,
losses, timings, and the drafter's served-equivalent τ on training and held-out prompts,
`validation`, whose held-out prompts are those of held_out_prompts.json). With
--target-steps/--drafter-steps the run repeats a logged one instead of fitting the budget.
--num-swapped / --num-invented / --pick-by-length change the drafter's data (see
`train_drafter.behind_other_prompts`); --target-eval-every keeps the target's weights where
its loss on a validation split of the training conversations was lowest; --generate-only
stops once the target's answers are written (for a later run's --generations); --target-loss
answer puts the target's loss on the answers only (what made it copy from grounded prompts),
--copy-warmup-steps trains its first steps on copy drills, and --target-probe-every logs
held-out token accuracies while it trains. Before any drafter work the log counts the
target's exactly right answers by kind of question (`answers_right`,
`training.answer_accuracy`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from bench.timing import run_facts
from dflash_serve.checkpoint.byte_tokenizer import special_ids_in
from training.answer_accuracy import (
    answer_groups,
    continuation_accuracy,
    count_right,
    token_accuracy,
)
from training.copy_drills import copy_drills
from training.corpus import (
    build_corpus,
    invented_question,
    is_grounded,
    is_validation,
    load_corpus,
    prompt_text,
    render_chat,
    rephrased_question,
    subject_of,
)
from training.drafter_eval import walk_tau
from training.embedded_configs import embedded_drafter_config, embedded_target_config
from training.export import save_drafter, save_target
from training.generate import generate_greedy, load_generating_target
from training.generation_cache import cached_answers
from training.schedule import OptimSettings
from training.target_lm import init_target
from training.tokenizer import (
    conversation_ids_with_answer_start,
    train_tokenizer,
    write_tokenizer,
)
from training.train_drafter import (
    DrafterTraining,
    GeneratedSequence,
    behind_other_prompts,
    init_drafter,
    train_drafter,
)
from training.train_target import TargetTraining, train_target


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--corpus", type=Path, help="saved corpus (default: build it here)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--target-budget-s", type=float, default=270.0)
    parser.add_argument("--target-steps", type=int)
    parser.add_argument(
        "--target-eval-every",
        type=int,
        default=0,
        help="measure the target's loss on a validation split of the training conversations "
        "(3 %%, set aside) every N steps and keep the weights where it was lowest (0: train "
        "on every conversation to the end)",
    )
    parser.add_argument(
        "--target-loss",
        choices=("all", "answer"),
        default="all",
        help="the target's loss over whole conversations, or over their answers only",
    )
    parser.add_argument(
        "--copy-warmup-steps",
        type=int,
        default=0,
        help="train the target's first N steps on copy drills (training.copy_drills)",
    )
    parser.add_argument(
        "--closed-book-repeats",
        type=int,
        default=1,
        metavar="R",
        help="train the target on each closed-book conversation R times per pass over a "
        "grounded corpus (whose K grounded variants per object otherwise outnumber them)",
    )
    parser.add_argument(
        "--target-probe-every",
        type=int,
        default=0,
        help="every N target steps, log token accuracy on held-out grounded and closed-book "
        "answers and on fresh copy drills (0: none)",
    )
    parser.add_argument("--tokens-per-step", type=int, default=32768)
    parser.add_argument("--max-row-tokens", type=int, default=512)
    parser.add_argument("--num-generations", type=int, default=8192)
    parser.add_argument(
        "--num-rephrased",
        type=int,
        default=0,
        help="also generate for this many training subjects asked in another phrasing",
    )
    parser.add_argument(
        "--num-invented",
        type=int,
        default=0,
        help="also generate for this many invented subjects (training names recombined)",
    )
    parser.add_argument(
        "--num-swapped",
        type=int,
        default=0,
        help="also train on this many generated answers put behind invented questions",
    )
    parser.add_argument(
        "--pick-by-length",
        action="store_true",
        help="pick drafter training sequences in proportion to their answer's length",
    )
    parser.add_argument(
        "--num-validation",
        type=int,
        default=64,
        help="held-out and training prompts whose served-equivalent tau is logged at the end",
    )
    parser.add_argument(
        "--reuse-target",
        type=Path,
        help="a target dir trained earlier (with its tokenizer): train only the drafter",
    )
    parser.add_argument(
        "--drafter-layers", type=int, help="drafter depth (default 3; the shipped drafter has 6)"
    )
    parser.add_argument(
        "--init-drafter",
        type=Path,
        help="continue training this saved drafter (its own depth) instead of a random one",
    )
    parser.add_argument(
        "--generations",
        type=Path,
        help="the target's answers: reused from this file when it matches the target, numerics "
        "and prompts, else generated and written there; a named file for anything else is "
        "refused (default OUT_DIR/generations.json, replaced when it does not match)",
    )
    parser.add_argument(
        "--generate-only",
        action="store_true",
        help="stop once the target's answers are written (--generations or OUT_DIR/"
        "generations.json): generating many is a command of its own on a time-limited GPU",
    )
    parser.add_argument(
        "--num-answer-checks",
        type=int,
        default=48,
        help="questions per kind (closed-book/grounded, held-out/training) whose greedy answer "
        "is checked against the reference text before any drafter work (0: none)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--drafter-budget-s", type=float, default=120.0)
    parser.add_argument("--drafter-steps", type=int)
    parser.add_argument(
        "--drafter-peak-lr",
        type=float,
        default=1e-3,
        help="the drafter's peak learning rate (a run continuing with --init-drafter may "
        "want less: each run starts its own warm-up and cosine schedule)",
    )
    parser.add_argument("--drafter-warmup-steps", type=int, default=50)
    parser.add_argument("--drafter-batch", type=int, default=64)
    parser.add_argument("--anchors-per-seq", type=int, default=16)
    parser.add_argument("--commit", help="commit to record (default: git rev-parse)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    target_dir, drafter_dir = args.out_dir / "target", args.out_dir / "drafter"
    record = run_facts("python -m training.embedded_pair " + " ".join(argv or sys.argv[1:]))
    record |= {
        "commit": args.commit or record["commit"],
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "seed": args.seed,
    }

    corpus = load_corpus(args.corpus) if args.corpus else build_corpus(args.seed)
    record["corpus"] = corpus.source
    log(f"corpus: {len(corpus.train)} training, {len(corpus.held_out)} held-out conversations")
    if args.reuse_target:
        target_dir = args.reuse_target
        tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
        specials = special_ids_in(tokenizer)
        record["target_training"] = f"reused {target_dir}"
    else:
        tokenizer = train_tokenizer((render_chat(c) for c in corpus.train), args.vocab_size)
        specials = write_tokenizer(tokenizer, target_dir)
    eos_ids = [specials["<|im_end|>"], specials["<|endoftext|>"]]
    if not args.reuse_target:
        train_target_model(args, corpus, tokenizer, specials, eos_ids, target_dir, record)

    target = load_generating_target(target_dir, args.device)
    served_dtype = target.embed_tokens.weight.dtype
    if args.num_answer_checks:
        log("answers checked against the reference text:")
        groups = answer_groups(corpus, args.num_answer_checks)
        record["answers_right"] = count_right(
            target, tokenizer, groups, eos_ids, args.max_new_tokens, log
        )
    rng = random.Random(args.seed)
    chosen = rng.sample(list(corpus.train), min(args.num_generations, len(corpus.train)))
    questions = [c.question for c in chosen]
    rephrase = rng.sample(list(corpus.train), min(args.num_rephrased, len(corpus.train)))
    questions += [rephrased_question(c, rng) for c in rephrase]
    known = {subject_of(c) for c in (*corpus.train, *corpus.held_out)}
    questions += [invented_question(corpus.train, rng, known) for _ in range(args.num_invented)]
    prompts = [tokenizer.encode(prompt_text(q)).ids for q in questions]
    began = time.perf_counter()
    answers, reused = cached_answers(
        args.generations or args.out_dir / "generations.json",
        target_dir,
        prompts,
        args.max_new_tokens,
        eos_ids,
        f"{str(served_dtype).removeprefix('torch.')} on {torch.device(args.device).type}",
        lambda: generate_greedy(target, prompts, args.max_new_tokens, eos_ids, log=log),
        refuse_other=args.generations is not None,
        log=log,
    )
    generated = [
        GeneratedSequence(p + a, len(p))
        for p, a in zip(prompts, answers, strict=True)
        if len(a) > 1
    ]
    record["generation"] = {
        "num_prompts": len(prompts),
        "num_tokens": sum(map(len, answers)),
        "seconds": round(time.perf_counter() - began, 1),
        "max_new_tokens": args.max_new_tokens,
        "reused": reused,
    }
    log(f"{'reused' if reused else 'generated'} {record['generation']}")
    if args.generate_only:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "training_log.json").write_text(json.dumps(record, indent=2))
        log(f"wrote the answers; log {args.out_dir / 'training_log.json'}")
        return record
    if args.num_swapped:
        swap_questions = [
            invented_question(corpus.train, rng, known) for _ in range(args.num_swapped)
        ]
        swap_prompts = [tokenizer.encode(prompt_text(q)).ids for q in swap_questions]
        training_sequences = generated + behind_other_prompts(generated, swap_prompts, rng)
        record["generation"]["num_swapped"] = args.num_swapped
    else:
        training_sequences = generated

    drafter_config = embedded_drafter_config(
        tokenizer.get_vocab_size(), specials["<|mask|>"], args.drafter_layers or 3
    )
    if args.init_drafter:
        drafter_config = json.loads((args.init_drafter / "config.json").read_text())
        drafter_config.pop("dtype", None)
        depth = drafter_config["num_hidden_layers"]
        if args.drafter_layers not in (None, depth):
            raise SystemExit(f"--drafter-layers {args.drafter_layers}: --init-drafter has {depth}")
        record["drafter_init"] = str(args.init_drafter)
    drafter = init_drafter(drafter_config, target_dir, args.seed, args.device, args.init_drafter)
    drafter_settings = DrafterTraining(
        batch_seqs=args.drafter_batch,
        anchors_per_seq=args.anchors_per_seq,
        budget_s=args.drafter_budget_s,
        num_steps=args.drafter_steps,
        optim=OptimSettings(args.drafter_peak_lr, args.drafter_warmup_steps),
        seed=args.seed,
        pick_by_length=args.pick_by_length,
    )
    pad_id = specials["<|endoftext|>"]
    record["drafter_optim"] = dataclasses.asdict(drafter_settings.optim)
    record["drafter_training"] = train_drafter(
        drafter, target, training_sequences, drafter_settings, pad_id, log
    )
    save_drafter(drafter, drafter_config, drafter_dir)

    held_out_sets = held_out_prompt_sets(corpus, args.seed)
    held_out = held_out_sets["held_out_prompts.json"]
    if args.num_validation:
        record["validation"] = validate_drafter(
            drafter, target, generated, held_out, tokenizer, eos_ids, args.num_validation
        )
        log(f"served-equivalent tau: {record['validation']}")
    for file_name, prompts in held_out_sets.items():
        (args.out_dir / file_name).write_text(json.dumps(prompts, indent=1))
    (args.out_dir / "training_log.json").write_text(json.dumps(record, indent=2))
    log(f"wrote {target_dir}, {drafter_dir}; log {args.out_dir / 'training_log.json'}")
    return record


def held_out_prompt_sets(corpus, seed: int) -> dict[str, list[str]]:
    """File name → held-out chat prompts, shuffled so any first N mix modules. With grounded
    conversations in the corpus, held_out_prompts.json holds those (the questions the pair
    answers from quoted documentation: what `bench.embedded` measures by default) and
    held_out_closed_book_prompts.json the others; without, the first holds them all."""
    pairs = [(prompt_text(c.question), is_grounded(c)) for c in corpus.held_out]
    random.Random(seed).shuffle(pairs)
    if not any(grounded for _, grounded in pairs):
        return {"held_out_prompts.json": [prompt for prompt, _ in pairs]}
    return {
        "held_out_prompts.json": [prompt for prompt, grounded in pairs if grounded],
        "held_out_closed_book_prompts.json": [prompt for prompt, grounded in pairs if not grounded],
    }


def validate_drafter(
    drafter, target, generated, held_out, tokenizer, eos_ids, count, max_new_tokens=128
) -> dict:
    """Served-equivalent τ (`drafter_eval.walk_tau`, 128 new tokens as `bench.embedded`) on
    the first `count` training generations and on `count` held-out prompts (generated here):
    the number that tells whether the drafter generalises, before any benchmark."""
    drafter.eval()
    trained = [
        (s.token_ids[: s.first_anchor], s.token_ids[s.first_anchor :][:max_new_tokens])
        for s in generated[:count]
    ]
    prompts = [tokenizer.encode(p).ids for p in held_out[:count]]
    answers = generate_greedy(target, prompts, max_new_tokens, eos_ids, log=log)
    result = {}
    for name, pairs in (
        ("training", trained),
        ("held_out", list(zip(prompts, answers, strict=True))),
    ):
        walk = walk_tau(drafter, target, pairs, max_new_tokens, eos_ids)
        result[name] = {"tau": walk.tau, "num_steps": walk.num_steps,
                        "accept_per_position": walk.accept_per_position}  # fmt: skip
    return result


def train_target_model(args, corpus, tokenizer, specials, eos_ids, target_dir, record) -> None:
    def rows(conversations):
        """(ids, index of the answer's first token) per conversation."""
        return [
            conversation_ids_with_answer_start(tokenizer, prompt_text(c.question), c.answer)
            for c in conversations
        ]

    training = target_conversations(corpus, args.closed_book_repeats, args.target_eval_every > 0)
    sequences, loss_starts = (list(x) for x in zip(*rows(training), strict=True))
    validation = [
        ids for ids, _ in rows(c for c in corpus.train if is_validation(c.name))
    ] if args.target_eval_every else []  # fmt: skip
    num_tokens = sum(map(len, sequences))
    record["corpus_tokens"] = num_tokens
    log(f"tokenizer: {tokenizer.get_vocab_size()} ids; corpus {num_tokens} tokens")
    target_config = embedded_target_config(tokenizer.get_vocab_size(), eos_ids)
    model = init_target(target_config, args.seed, args.device)
    target_settings = TargetTraining(
        tokens_per_step=args.tokens_per_step,
        max_row_tokens=args.max_row_tokens,
        budget_s=args.target_budget_s,
        num_steps=args.target_steps,
        optim=OptimSettings(peak_lr=2e-3, warmup_steps=100),
        seed=args.seed,
        pad_id=specials["<|endoftext|>"],
        eval_every=args.target_eval_every,
        warmup_steps=args.copy_warmup_steps,
        probe_every=args.target_probe_every,
    )
    drill = drill_maker(tokenizer, specials)
    # About one pass: no drill is seen twice, so none can be memorised instead of copied.
    mean_drill_tokens = sum(DRILL_LENGTHS) + 2  # the mean run twice, and two specials
    warmup_rows = drill(
        args.copy_warmup_steps * args.tokens_per_step // mean_drill_tokens + 1, args.seed
    ) if args.copy_warmup_steps else None  # fmt: skip
    probe = target_probe(model, tokenizer, corpus, drill) if args.target_probe_every else None
    record["target_training"] = train_target(
        model, sequences, target_settings, log, validation,
        loss_starts=loss_starts if args.target_loss == "answer" else None,
        warmup_rows=warmup_rows, probe=probe,
    )  # fmt: skip
    record["target_training"]["loss"] = args.target_loss
    record["target_training"]["closed_book_repeats"] = args.closed_book_repeats
    save_target(model, target_config, target_dir)


def target_conversations(corpus, closed_book_repeats: int, hold_validation: bool) -> list:
    """The target's training conversations: each closed-book one `closed_book_repeats`
    times, each grounded one once, less the validation split if it is held back."""
    if closed_book_repeats < 1:
        raise SystemExit(f"--closed-book-repeats {closed_book_repeats}: 1 or more")
    kept = [c for c in corpus.train if not (hold_validation and is_validation(c.name))]
    return [c for c in kept for _ in range(1 if is_grounded(c) else closed_book_repeats)]


DRILL_LENGTHS = (16, 128)


def drill_maker(tokenizer, specials):
    """count, seed → copy drills over the tokenizer's non-special ids."""
    special = set(specials.values())
    pool = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
    separator, end = specials["<|im_start|>"], specials["<|im_end|>"]

    def make(count: int, seed: int):
        return copy_drills(count, pool, separator, end, DRILL_LENGTHS, seed)

    return make


def target_probe(model, tokenizer, corpus, drill, count: int = 16):
    """What the target can do mid-training: token accuracy on `count` held-out grounded
    answers (copying), closed-book ones (the baseline: nothing to copy) and fresh drills."""
    groups = answer_groups(corpus, count)
    sequences, starts = drill(count, seed=10_000)
    drills = list(zip(sequences, starts, strict=True))

    def probe() -> dict[str, float]:
        was_training = model.training
        model.eval()
        measures = {
            name: round(token_accuracy(model, tokenizer, groups[name]), 4)
            for name in ("held_out_grounded", "held_out")
            if name in groups
        }
        measures["copy_drills"] = round(continuation_accuracy(model, drills), 4)
        model.train(was_training)
        return measures

    return probe


if __name__ == "__main__":
    main()
