"""The target's greedy answers kept on disk, so chained drafter runs skip regenerating them.

A GPU command is limited to 10 minutes and generating the drafter's labels takes 1–2 of
them; a drafter trained over several commands (`--init-drafter`) reuses the first command's
answers. The file records what the answers depend on (the target's weights, the prompts, the
answer length, the stop ids) and is refused when any of them differs, never silently reused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path


def weights_digest(target_dir: Path) -> str:
    """sha256 of the target's weight files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(target_dir.glob("*.safetensors")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cached_answers(
    path: Path,
    target_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_ids: list[int],
    generate: Callable[[], list[list[int]]],
) -> tuple[list[list[int]], bool]:
    """(answers, whether they came from `path`): loads them when `path` holds answers to
    exactly these prompts by exactly this target, else runs `generate` and writes `path`."""
    key = {
        "target_weights_sha256": weights_digest(target_dir),
        "max_new_tokens": max_new_tokens,
        "eos_token_ids": list(eos_token_ids),
        "prompts": prompts,
    }
    if path.exists():
        saved = json.loads(path.read_text())
        differing = [name for name, value in key.items() if saved.get(name) != value]
        if differing:
            raise ValueError(
                f"{path} holds answers for another {', '.join(differing)}; "
                "delete it or name another file"
            )
        return saved["answers"], True
    answers = generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(key | {"answers": answers}))
    return answers, False
