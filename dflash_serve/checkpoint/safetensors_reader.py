"""Lazy access to the tensors of a checkpoint directory, single-file or sharded.

Only the tensors asked for are read, so the vision tower and MTP head of a multimodal
checkpoint never reach memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dflash_serve.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1, "I8": 1, "BOOL": 1}


class TensorReader:
    """Maps tensor names to the shard that holds them and reads them on demand."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self._shard_of = self._build_shard_map()
        self._open_files: dict[Path, object] = {}

    def _build_shard_map(self) -> dict[str, Path]:
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as error:
                raise CheckpointError(f"{index}: unreadable shard index ({error})") from error
            shard_map = {name: self.model_dir / shard for name, shard in weight_map.items()}
            missing = sorted({p.name for p in shard_map.values() if not p.is_file()})
            if missing:
                raise CheckpointError(f"{index} names shards that are missing: {missing}")
            return shard_map
        single = self.model_dir / SINGLE_FILE
        if not single.is_file():
            raise CheckpointError(f"{self.model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        with self._open(single) as handle:
            return dict.fromkeys(handle.keys(), single)

    def _open(self, path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from error

    def names(self) -> list[str]:
        return list(self._shard_of)

    def has(self, name: str) -> bool:
        return name in self._shard_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def nbytes(self, name: str) -> int:
        """Stored size of a tensor, without reading it."""
        info = self._handle(name).get_slice(name)
        numel = 1
        for size in info.get_shape():
            numel *= size
        return numel * DTYPE_BYTES[info.get_dtype()]

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor; a missing or corrupt tensor raises CheckpointError naming it."""
        try:
            return self._handle(name).get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as error:
            raise CheckpointError(
                f"{self._shard_of[name]}: tensor {name!r} could not be read ({error})"
            ) from error

    def _handle(self, name: str):
        if name not in self._shard_of:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} is missing")
        path = self._shard_of[name]
        if path not in self._open_files:
            self._open_files[path] = self._open(path).__enter__()
        return self._open_files[path]
