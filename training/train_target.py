"""Train the embedded target: next-token prediction on whole chat conversations.

Every row is one conversation starting at position 0 with an empty state, exactly as a
request is served (packing conversations into shared rows taught an earlier run to expect
context it never gets at serving time). Rows of similar length share a batch, so little
is padding; padding is masked out of the loss.

With validation conversations and `eval_every`, the loss on them is measured every that
many steps and the weights of the lowest one are what training leaves: trained to the end
of its schedule the shipped target recites its training answers (loss 0.09 after 116
epochs) and strings pieces of them together for any question it has not seen.

`loss_starts` limits a row's loss to the tokens from that index on (a conversation's
answer: a grounded prompt quoting random text has nothing to learn before it). Warm-up rows
(`copy_drills`) fill the first `warmup_steps` steps. A `probe` (a function returning named
measures, e.g. held-out token accuracy) runs every `probe_every` steps and after the last,
so a sudden change in what the model can do is visible in the log.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    eval_every: int = 0  # steps between validation losses (0: none)
    warmup_steps: int = 0  # first steps trained on the warm-up rows instead
    probe_every: int = 0  # steps between probes (0: none)


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


def padded_rows(
    sequences: list[list[int]],
    indices: list[int],
    settings: TargetTraining,
    loss_starts: Sequence[int] | None = None,
):
    """(inputs [B, W], labels [B, W]) with labels −100 past each conversation's end and,
    with loss_starts, for every token before its row's start."""
    rows = [sequences[i][: settings.max_row_tokens] for i in indices]
    width = max(map(len, rows)) - 1
    inputs = torch.full((len(rows), width), settings.pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for r, row in enumerate(rows):
        inputs[r, : len(row) - 1] = torch.tensor(row[:-1])
        labels[r, : len(row) - 1] = torch.tensor(row[1:])
        if loss_starts is not None:
            labels[r, : max(loss_starts[indices[r]] - 1, 0)] = IGNORE_INDEX
    return inputs, labels


class BatchStream:
    """Endless batches: a fresh grouping and shuffle every epoch."""

    def __init__(
        self,
        sequences: list[list[int]],
        settings: TargetTraining,
        loss_starts: Sequence[int] | None = None,
    ) -> None:
        self.sequences = sequences
        self.loss_starts = loss_starts
        self.settings = settings
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.pending: list[list[int]] = []
        self.epochs = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.pending:
            self.pending = length_batches(self.sequences, self.settings, self.generator)
            self.epochs += 1
        indices = self.pending.pop()
        return padded_rows(self.sequences, indices, self.settings, self.loss_starts)


@torch.no_grad()
def validation_loss(model, sequences: list[list[int]], settings: TargetTraining) -> float:
    """Mean next-token loss over every token of `sequences` (batched as in training)."""
    device = model.embed_tokens.weight.device
    generator = torch.Generator().manual_seed(0)
    total = count = 0.0
    was_training = model.training
    model.eval()
    with mixed_precision(device):
        for indices in length_batches(sequences, settings, generator):
            inputs, labels = (t.to(device) for t in padded_rows(sequences, indices, settings))
            num_labels = int((labels != IGNORE_INDEX).sum())
            total += float(lm_loss(model, inputs, labels)) * num_labels
            count += num_labels
    model.train(was_training)
    return total / count


def train_target(
    model,
    sequences: list[list[int]],
    settings: TargetTraining,
    log,
    validation: list[list[int]] = (),
    loss_starts: Sequence[int] | None = None,
    warmup_rows: tuple[list[list[int]], Sequence[int]] | None = None,
    probe: Callable[[], dict[str, float]] | None = None,
) -> dict:
    """Train in place; returns a log of the run (steps, losses, epochs, seconds). With
    `validation` and `settings.eval_every`, the model is left with the weights of the step
    whose validation loss was lowest (also measured after the last step). `warmup_rows`
    ((sequences, loss starts)) train the first `settings.warmup_steps` steps."""
    if settings.warmup_steps and not warmup_rows:
        raise ValueError("warmup_steps needs warmup_rows")
    device = model.embed_tokens.weight.device
    torch.manual_seed(settings.seed)
    optimizer = make_optimizer(model.parameters(), settings.optim)
    stream = BatchStream(sequences, settings, loss_starts)
    warmup = BatchStream(warmup_rows[0], settings, warmup_rows[1]) if warmup_rows else None
    autocast = mixed_precision(device)
    seen_tokens = [0]
    evaluating = bool(validation) and settings.eval_every > 0
    curve: list[tuple[int, float]] = []  # (steps done, validation loss)
    best: dict = {}
    probes: list[tuple[int, dict[str, float]]] = []

    def run_probe(steps_done: int) -> None:
        measures = probe()
        probes.append((steps_done, measures))
        shown = ", ".join(f"{name} {value:.3f}" for name, value in measures.items())
        log(f"  target probe after {steps_done} steps: {shown}")

    def evaluate(steps_done: int) -> None:
        loss = validation_loss(model, list(validation), settings)
        curve.append((steps_done, round(loss, 4)))
        if not best or loss < best["loss"]:
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            best.update(loss=loss, steps=steps_done, epochs=stream.epochs, weights=weights)
        log(f"  target validation loss {loss:.3f} after {steps_done} steps")

    def run_step(step: int, progress: float) -> float:
        if evaluating and step and step % settings.eval_every == 0:
            evaluate(step)
        if probe and settings.probe_every and step and step % settings.probe_every == 0:
            run_probe(step)
        source = warmup if step < settings.warmup_steps else stream
        inputs, labels = (t.to(device, non_blocking=True) for t in source.next_batch())
        seen_tokens[0] += int((labels != IGNORE_INDEX).sum())
        with autocast:
            loss = lm_loss(model, inputs, labels)
        apply_update(optimizer, loss, step, progress, settings.optim)
        return loss.item()

    num_steps, losses, seconds = run_steps(
        run_step, settings.num_steps, settings.budget_s, log, "target"
    )
    report = {
        "num_steps": num_steps,
        "tokens": seen_tokens[0],
        "epochs": stream.epochs,
        "seconds": round(seconds, 1),
        **loss_summary(losses),
    }
    if settings.warmup_steps:
        report["warmup_steps"] = min(settings.warmup_steps, num_steps)
    if probe and settings.probe_every:
        run_probe(num_steps)
        report["probe_by_step"] = probes
    if evaluating:
        evaluate(num_steps)
        model.load_state_dict(best.pop("weights"))
        report["validation"] = {
            "num_sequences": len(validation),
            "loss_by_step": curve,
            "kept_step": best["steps"],
            "kept_loss": round(best["loss"], 4),
            "kept_epochs": best["epochs"],
        }
        log(f"  target: kept the weights after {best['steps']} steps ({best['loss']:.3f})")
    return report
