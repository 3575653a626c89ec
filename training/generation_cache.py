"""The target's greedy answers kept on disk, so chained drafter runs skip regenerating them.

A GPU command is limited to 10 minutes and generating the drafter's labels takes 1–2 of
them; a drafter trained over several commands (`--init-drafter`) reuses the first command's
answers. The file records what the answers depend on (the target's weights and config, the
dtype and device type they ran in, the prompts, the answer length, the stop ids) and is never
reused when any of them differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path


def target_digest(target_dir: Path) -> str:
    """sha256 of the target's config and weight files, in name order."""
    digest = hashlib.sha256()
    for path in sorted([target_dir / "config.json", *target_dir.glob("*.safetensors")]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cached_answers(
    path: Path,
    target_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_ids: list[int],
    numerics: str,
    generate: Callable[[], list[list[int]]],
    refuse_other: bool = True,
    log: Callable[[str], None] = print,
) -> tuple[list[list[int]], bool]:
    """(answers, whether they came from `path`): loads them when `path` holds answers to
    exactly these prompts by exactly this target in these numerics (e.g. "bfloat16 on
    cuda"), else runs `generate` and writes `path`. A file for anything else raises
    ValueError naming what differs, or with refuse_other=False is replaced (a default path
    left by an earlier run)."""
    key = {
        "target_sha256": target_digest(target_dir),
        "numerics": numerics,
        "max_new_tokens": max_new_tokens,
        "eos_token_ids": list(eos_token_ids),
        "prompts": prompts,
    }
    if path.exists():
        try:
            saved = json.loads(path.read_text())
        except json.JSONDecodeError:
            saved = {}
        differing = [name for name, value in key.items() if saved.get(name) != value]
        if not differing:
            return saved["answers"], True
        message = f"{path} holds answers for another {', '.join(differing)}"
        if refuse_other:
            raise ValueError(f"{message}; delete it or name another file")
        log(f"{message}: generating them again")
    answers = generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(key | {"answers": answers}))
    os.replace(partial, path)  # a run killed while writing leaves the old file or none
    return answers, False
