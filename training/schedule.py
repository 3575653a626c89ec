"""Optimiser, learning-rate schedule and a step budget fitted to a wall-clock budget.

Training runs inside a fixed device-time budget. The number of steps is fixed once, after
timing a few steps, so the cosine schedule knows where it ends; the chosen count is
recorded, and passing it back as `num_steps` reproduces the run without the timing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OptimSettings:
    peak_lr: float
    warmup_steps: int
    weight_decay: float = 0.1
    min_lr_frac: float = 0.1


def make_optimizer(parameters, settings: OptimSettings) -> torch.optim.AdamW:
    """AdamW; matrices decay, norms and scalars do not."""
    parameters = [p for p in parameters if p.requires_grad]
    decay = [p for p in parameters if p.ndim >= 2]
    other = [p for p in parameters if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": settings.weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=settings.peak_lr, betas=(0.9, 0.95), eps=1e-8)


def learning_rate(step: int, num_steps: int, settings: OptimSettings) -> float:
    """Linear warm-up, then cosine decay to min_lr_frac of the peak."""
    if step < settings.warmup_steps:
        return settings.peak_lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(num_steps - settings.warmup_steps, 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    floor = settings.min_lr_frac
    return settings.peak_lr * (floor + (1 - floor) * cosine)


def run_steps(
    run_step: Callable[[int, int], float],
    num_steps: int | None,
    budget_s: float,
    num_timed: int,
    log: Callable[[str], None],
    label: str,
) -> tuple[int, list[float], float]:
    """Run run_step(step, num_steps) → loss for num_steps steps; when num_steps is None,
    time the first num_timed steps (inside the warm-up) and fix the count that fits
    budget_s. Returns (num_steps, losses, seconds)."""
    began = time.perf_counter()
    losses = []
    if num_steps is None:
        losses.append(run_step(0, num_timed))  # pays for allocation and kernel selection
        timed_from = time.perf_counter()
        for step in range(1, num_timed):
            losses.append(run_step(step, num_timed))
        per_step_s = (time.perf_counter() - timed_from) / max(num_timed - 1, 1)
        num_steps = max(num_timed, int(budget_s / per_step_s))
    log(f"{label}: {num_steps} steps")
    for step in range(len(losses), num_steps):
        losses.append(run_step(step, num_steps))
        if step % 100 == 0 or step == num_steps - 1:
            elapsed = time.perf_counter() - began
            log(f"  {label} step {step}: loss {losses[-1]:.3f}, {elapsed:.0f} s")
    return num_steps, losses, time.perf_counter() - began


def loss_summary(losses: list[float]) -> dict:
    return {
        "loss_every_100": [round(x, 4) for x in losses[::100]],
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
    }
