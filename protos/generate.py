"""Regenerate the Python stubs in dflash_protos/ from the .proto files beside this script.

Run from the repository root: `python protos/generate.py`. The stubs are committed so a plain
`pip install` gives importable modules; tests/test_protos.py fails when they are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PACKAGE = "dflash_protos"


def generate(out_root: Path) -> list[Path]:
    """Compile every .proto into out_root/dflash_protos/; return the files written."""
    from grpc_tools import protoc

    (out_root / PACKAGE).mkdir(parents=True, exist_ok=True)
    include = protoc._get_resource_file_name("grpc_tools", "_proto")
    sources = sorted(PROTO_DIR.glob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE}={PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[f"{PACKAGE}/{p.name}" for p in sources],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    init = out_root / PACKAGE / "__init__.py"
    init.write_text('"""Generated gRPC stubs; regenerate with `python protos/generate.py`."""\n')
    return sorted((out_root / PACKAGE).iterdir())


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR.parent
    for path in generate(root):
        print(path)
