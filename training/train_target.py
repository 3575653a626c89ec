"""Train the embedded target: next-token prediction on whole chat conversations.

Every row is one conversation starting at position 0 with an empty state, exactly as a
request is served (packing conversations into shared rows taught an earlier run to expect
context it never gets at serving time). Rows of similar length share a batch, so little
is padding; padding is masked out of the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.schedule import (
    OptimSettings,
    apply_update,
    loss_summary,
    make_optimizer,
    mixed_precision,
    run_steps,
)
from training.target_lm import lm_loss

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TargetTraining:
    tokens_per_step: int  # rows × padded length, at most
    max_row_tokens: int  # longer conversations are truncated
    budget_s: float  # used when num_steps is None
    num_steps: int | None
    optim: OptimSettings
    seed: int
    pad_id: int


def length_batches(
    sequences: list[list[int]], settings: TargetTraining, generator: torch.Generator
) -> list[list[int]]:
    """One epoch: sequence indices grouped by length (random order among equals), cut into
    batches of at most tokens_per_step padded tokens, batches shuffled."""
    noise = torch.rand(len(sequences), generator=generator).tolist()
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i]), noise[i]))
    batches, current = [], []
    for index in order:
        width = min(len(sequences[index]), settings.max_row_tokens)
        if current and (len(current) + 1) * width > settings.tokens_per_step:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    shuffle = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in shuffle]


def padded_rows(sequences: list[list[int]], indices: list[int], settings: TargetTraining):
    """(inputs [B, W], labels [B, W]) with labels −100 past each conversation's end."""
    rows = [sequences[i][: settings.max_row_tokens] for i in indices]
    width = max(map(len, rows)) - 1
    inputs = torch.full((len(rows), width), settings.pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for r, row in enumerate(rows):
        inputs[r, : len(row) - 1] = torch.tensor(row[:-1])
        labels[r, : len(row) - 1] = torch.tensor(row[1:])
    return inputs, labels


class BatchStream:
    """Endless batches: a fresh grouping and shuffle every epoch."""

    def __init__(self, sequences: list[list[int]], settings: TargetTraining) -> None:
        self.sequences = sequences
        self.settings = settings
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.pending: list[list[int]] = []
        self.epochs = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.pending:
            self.pending = length_batches(self.sequences, self.settings, self.generator)
            self.epochs += 1
        return padded_rows(self.sequences, self.pending.pop(), self.settings)


def train_target(model, sequences: list[list[int]], settings: TargetTraining, log) -> dict:
    """Train in place; returns a log of the run (steps, losses, epochs, seconds)."""
    device = model.embed_tokens.weight.device
    torch.manual_seed(settings.seed)
    optimizer = make_optimizer(model.parameters(), settings.optim)
    stream = BatchStream(sequences, settings)
    autocast = mixed_precision(device)
    seen_tokens = [0]

    def run_step(step: int, progress: float) -> float:
        inputs, labels = (t.to(device, non_blocking=True) for t in stream.next_batch())
        seen_tokens[0] += int((labels != IGNORE_INDEX).sum())
        with autocast:
            loss = lm_loss(model, inputs, labels)
        apply_update(optimizer, loss, step, progress, settings.optim)
        return loss.item()

    num_steps, losses, seconds = run_steps(
        run_step, settings.num_steps, settings.budget_s, log, "target"
    )
    return {
        "num_steps": num_steps,
        "tokens": seen_tokens[0],
        "epochs": stream.epochs,
        "seconds": round(seconds, 1),
        **loss_summary(losses),
    }
