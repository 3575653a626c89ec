"""The committed stubs in dflash_protos/ match what protos/*.proto generate now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_are_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    fresh = {p.name: p.read_bytes() for p in generate.generate(tmp_path)}
    committed = {p.name: p.read_bytes() for p in (ROOT / "dflash_protos").iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed), "run `python protos/generate.py`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run `python protos/generate.py`"


def test_every_field_is_documented():
    """Each message field and RPC in our .proto files has a comment line above it."""
    undocumented = []
    for proto in sorted((ROOT / "protos").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for number, line in enumerate(lines):
            text = line.strip()
            is_field = text.endswith(";") and "=" in text and not text.startswith(("//", "option"))
            is_rpc = text.startswith("rpc ")
            previous = lines[number - 1].strip()
            if (is_field or is_rpc) and not previous.startswith("//"):
                undocumented.append(f"{proto.name}:{number + 1}: {text}")
    assert not undocumented, "\n".join(undocumented)
