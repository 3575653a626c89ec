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


def learning_rate(step: int, progress: float, settings: OptimSettings) -> float:
    """Linear warm-up over the first steps, then cosine decay (by progress in [0, 1]) to
    min_lr_frac of the peak."""
    if step < settings.warmup_steps:
        return settings.peak_lr * (step + 1) / settings.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    floor = settings.min_lr_frac
    return settings.peak_lr * (floor + (1 - floor) * cosine)


def mixed_precision(device: torch.device) -> torch.autocast:
    """bf16 autocast on a GPU; plain fp32 on the CPU (the tests' reference numerics)."""
    return torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")


def apply_update(
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    step: int,
    progress: float,
    settings: OptimSettings,
) -> None:
    """One optimiser update at the schedule's learning rate, gradients clipped to norm 1."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, progress, settings)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(parameters, 1.0)
    optimizer.step()


def run_steps(
    run_step: Callable[[int, float], float],
    num_steps: int | None,
    budget_s: float,
    log: Callable[[str], None],
    label: str,
) -> tuple[int, list[float], float]:
    """Call run_step(step, progress) → loss until num_steps steps, or (num_steps None) until
    budget_s seconds have passed; progress runs 0 → 1 over steps or over time. Returns
    (steps run, losses, seconds); the step count reproduces the schedule's length."""
    began = time.perf_counter()
    losses: list[float] = []
    mode = f"{num_steps} steps" if num_steps is not None else f"{budget_s:.0f} s"
    log(f"{label}: {mode}")
    while True:
        elapsed = time.perf_counter() - began
        progress = len(losses) / num_steps if num_steps is not None else elapsed / budget_s
        if progress >= 1.0:
            break
        step = len(losses)
        losses.append(run_step(step, progress))
        if step % 100 == 0:
            log(f"  {label} step {step}: loss {losses[-1]:.3f}, {elapsed:.0f} s")
    log(f"  {label}: {len(losses)} steps, last loss {losses[-1]:.3f}")
    return len(losses), losses, time.perf_counter() - began


def loss_summary(losses: list[float]) -> dict:
    return {
        "loss_every_100": [round(x, 4) for x in losses[::100]],
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
    }
