"""Turn a `--model` argument (local directory or hub id) into a local checkpoint directory."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from dflash_serve.errors import CheckpointError

logger = logging.getLogger(__name__)

HUB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Only what the engines read; a VLM repo's other files are not needed.
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")


def resolve_model_dir(path_or_id: str | Path) -> Path:
    """A local directory as is; a hub id (`org/name`) downloaded with huggingface_hub."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_id)
    if not HUB_ID_PATTERN.match(text):
        raise CheckpointError(f"model {text!r}: no such directory, and not a hub id (org/name)")
    logger.info("downloading %s from the Hugging Face hub", text)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=list(DOWNLOAD_PATTERNS)))
    except Exception as error:
        raise CheckpointError(
            f"model {text!r}: not a local directory and could not be downloaded "
            f"({type(error).__name__}: {error}). If this machine is offline, download it "
            f"elsewhere (huggingface-cli download {text} --local-dir DIR) and pass that "
            "directory instead."
        ) from error
