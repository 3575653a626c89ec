"""The embedded default model pair: what `dflash-serve up` serves when no model is named.

A small Qwen3.5-architecture target (6 layers: GDN + gated attention, 9 M parameters) and a
DFlash drafter (6 layers) trained against it, shipped with the package in
`launcher/embedded_pair/` (Hugging Face layout with a BPE tokenizer and chat template;
about 32 MB in bf16). They were trained on CPython's standard-library documentation by
`python -m training.embedded_pair` (see README: "The embedded demo pair"), so they answer a
question about documentation quoted in the prompt (a "### `name`" heading, the text, then
the question) with the quoted text, offline, on any machine.
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).parent / "embedded_pair"
WEIGHTS = "model.safetensors"


def embedded_model_pair() -> tuple[Path, Path]:
    """(target_dir, drafter_dir) of the shipped pair; a clear error if the install lacks it."""
    target_dir, drafter_dir = EMBEDDED_DIR / "target", EMBEDDED_DIR / "drafter"
    missing = [str(d / WEIGHTS) for d in (target_dir, drafter_dir) if not (d / WEIGHTS).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the embedded demo pair is missing from this installation ({', '.join(missing)}); "
            "reinstall dflash-serve, or name a model with --target"
        )
    return target_dir, drafter_dir
