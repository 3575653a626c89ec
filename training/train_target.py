"""Train the embedded target: next-token prediction on packed chat-formatted rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.schedule import (
    OptimSettings,
    learning_rate,
    loss_summary,
    make_optimizer,
    run_steps,
)
from training.target_lm import lm_loss


@dataclass(frozen=True)
class TargetTraining:
    batch_rows: int
    row_tokens: int
    budget_s: float  # used when num_steps is None
    num_steps: int | None
    optim: OptimSettings
    seed: int


def pack_rows(sequences: list[list[int]], row_tokens: int, generator: torch.Generator):
    """Shuffle whole sequences, concatenate them, cut into rows of row_tokens + 1 ids."""
    order = torch.randperm(len(sequences), generator=generator).tolist()
    stream = torch.tensor([t for i in order for t in sequences[i]], dtype=torch.long)
    num_rows = len(stream) // (row_tokens + 1)
    return stream[: num_rows * (row_tokens + 1)].reshape(num_rows, row_tokens + 1)


class RowStream:
    """Endless batches of packed rows: a fresh shuffle every epoch."""

    def __init__(self, sequences: list[list[int]], settings: TargetTraining) -> None:
        self.sequences = sequences
        self.settings = settings
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.rows = torch.empty(0, settings.row_tokens + 1, dtype=torch.long)
        self.next_row = 0
        self.epochs = 0

    def next_batch(self) -> torch.Tensor:
        size = self.settings.batch_rows
        if self.next_row + size > len(self.rows):
            self.rows = pack_rows(self.sequences, self.settings.row_tokens, self.generator)
            if len(self.rows) < size:
                raise ValueError(
                    f"corpus gives {len(self.rows)} rows of {self.settings.row_tokens} tokens; "
                    f"a batch needs {size}"
                )
            self.next_row = 0
            self.epochs += 1
        batch = self.rows[self.next_row : self.next_row + size]
        self.next_row += size
        return batch


def train_target(model, sequences: list[list[int]], settings: TargetTraining, log) -> dict:
    """Train in place; returns a log of the run (steps, losses, epochs, seconds)."""
    device = model.embed_tokens.weight.device
    torch.manual_seed(settings.seed)
    optimizer = make_optimizer(model.parameters(), settings.optim)
    stream = RowStream(sequences, settings)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")

    def run_step(step: int, num_steps: int) -> float:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, num_steps, settings.optim)
        rows = stream.next_batch().to(device, non_blocking=True)
        with autocast:
            loss = lm_loss(model, rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    num_timed = min(10, settings.optim.warmup_steps)
    label = f"target ({settings.batch_rows}×{settings.row_tokens} tokens per step)"
    num_steps, losses, seconds = run_steps(
        run_step, settings.num_steps, settings.budget_s, num_timed, log, label
    )
    return {
        "num_steps": num_steps,
        "tokens": num_steps * settings.batch_rows * settings.row_tokens,
        "epochs": stream.epochs,
        "seconds": round(seconds, 1),
        **loss_summary(losses),
    }
