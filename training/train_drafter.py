"""Train the embedded DFlash drafter against the frozen, trained target."""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_serve.checkpoint.synthetic import write_drafter
from drafter_service.model.dflash import DFlashDrafter
from drafter_service.model.loader import load_drafter
from training.drafter_blocks import block_logits, block_loss, sample_anchors
from training.schedule import (
    OptimSettings,
    apply_update,
    loss_summary,
    make_optimizer,
    mixed_precision,
    run_steps,
)
from training.target_lm import forward_rows


@dataclass(frozen=True)
class DrafterTraining:
    batch_seqs: int
    anchors_per_seq: int
    budget_s: float  # used when num_steps is None
    num_steps: int | None
    optim: OptimSettings
    seed: int
    # Pick sequences in proportion to their anchor positions (answer length − 1), so every
    # answer token is an anchor equally often (uniform picks under-train long answers: the
    # shipped drafter's accepted prefix falls from 8.1 tokens in an answer's first 32 to 1.0
    # past its 96th).
    pick_by_length: bool = False


@dataclass(frozen=True)
class GeneratedSequence:
    token_ids: list[int]  # prompt + the target's greedy answer
    first_anchor: int  # the prompt length: drafting starts at the first generated token


def init_drafter(
    config: dict, target_dir: Path, seed: int, device: str, from_dir: Path | None = None
) -> DFlashDrafter:
    """A trainable fp32 drafter bound to the trained target's embeddings: seeded random
    weights, or (from_dir) a drafter saved earlier, to train on where a run stopped (one
    GPU command is limited to minutes; the optimizer's moments and schedule start afresh)."""
    if from_dir is not None:
        drafter = load_drafter(from_dir, target_dir, torch.float32, device)
    else:
        with tempfile.TemporaryDirectory(prefix="dflash-init-") as workdir:
            write_drafter(Path(workdir), config, seed=seed)
            drafter = load_drafter(workdir, target_dir, torch.float32, device)
    drafter.train()
    for parameter in drafter.parameters():
        parameter.requires_grad_(True)
    return drafter


def behind_other_prompts(
    sequences: list[GeneratedSequence], prompts: list[list[int]], rng: random.Random
) -> list[GeneratedSequence]:
    """Each prompt followed by the answer of a randomly chosen sequence.

    Asked about something it never saw, the target recites another item's answer; a drafter
    trained only on answers behind their own questions learns each answer keyed on its
    question and fails there (held-out τ 1.4 on the very texts it predicts at τ 10 behind
    their own question). Answers behind other prompts teach it to follow the answer so far.
    The target's features are recomputed over the new pairing when training.
    """
    out = []
    for prompt in prompts:
        source = rng.choice(sequences)
        answer = source.token_ids[source.first_anchor :]
        out.append(GeneratedSequence(list(prompt) + answer, len(prompt)))
    return out


def pick_sequences(
    anchor_counts: list[int], count: int, by_length: bool, generator: torch.Generator
) -> torch.Tensor:
    """`count` sequence indices drawn with replacement: uniformly, or (by_length) in
    proportion to each sequence's number of possible anchors (its answer's length − 1, at
    least 1), so that every anchor position is drawn equally often."""
    if not by_length:
        return torch.randint(len(anchor_counts), (count,), generator=generator)
    weights = torch.tensor(anchor_counts, dtype=torch.float64).clamp(min=1)
    return torch.multinomial(weights, count, replacement=True, generator=generator)


def make_batch(sequences: list[GeneratedSequence], pad_id: int, device) -> tuple:
    lengths = torch.tensor([len(s.token_ids) for s in sequences])
    width = int(lengths.max())
    rows = [s.token_ids + [pad_id] * (width - len(s.token_ids)) for s in sequences]
    first = torch.tensor([s.first_anchor for s in sequences])
    return torch.tensor(rows, device=device), lengths.to(device), first


def train_drafter(
    drafter: DFlashDrafter,
    target,
    sequences: list[GeneratedSequence],
    settings: DrafterTraining,
    pad_id: int,
    log,
) -> dict:
    """Train in place against `target` (frozen); returns a log of the run."""
    device = drafter.fc.weight.device
    taps_ids = drafter.config.target_layer_ids
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = make_optimizer(drafter.parameters(), settings.optim)
    autocast = mixed_precision(device)
    accuracy_sum = torch.zeros(drafter.config.block_size - 1)
    accuracy_count = [0]

    anchor_counts = [len(s.token_ids) - 1 - s.first_anchor for s in sequences]

    def run_step(step: int, progress: float) -> float:
        picks = pick_sequences(
            anchor_counts, settings.batch_seqs, settings.pick_by_length, generator
        )
        token_ids, lengths, first = make_batch([sequences[i] for i in picks], pad_id, device)
        anchors = sample_anchors(first, lengths.cpu(), settings.anchors_per_seq, generator)
        anchors = anchors.to(device)
        with torch.no_grad(), autocast:
            _, taps = forward_rows(target, token_ids, taps_ids)
        with autocast:
            logits = block_logits(drafter, taps, token_ids, anchors)
        loss, accuracy = block_loss(logits, token_ids, anchors, lengths)
        apply_update(optimizer, loss, step, progress, settings.optim)
        if progress >= 0.95 and accuracy.numel():  # the last 5 % of the run
            accuracy_sum.add_(accuracy.cpu())
            accuracy_count[0] += 1
        return loss.item()

    label = f"drafter ({settings.batch_seqs} sequences × {settings.anchors_per_seq} blocks)"
    num_steps, losses, seconds = run_steps(
        run_step, settings.num_steps, settings.budget_s, log, label
    )
    prefix_accuracy = (accuracy_sum / max(accuracy_count[0], 1)).tolist()
    return {
        "num_steps": num_steps,
        "seconds": round(seconds, 1),
        **loss_summary(losses),
        # teacher-forced estimate over the last 5 % of steps: 1 + Σ P(slots 1..k all right)
        "train_tau_estimate": round(1 + sum(prefix_accuracy), 3),
        "train_prefix_accuracy": [round(x, 3) for x in prefix_accuracy],
    }
