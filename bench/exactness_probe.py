"""Which operations break row independence on this GPU (a diagnostic, not a benchmark).

Speculative output equals plain decoding only if a token's result does not depend on how
many rows share its forward. This prints, for every linear shape of Qwen3.5-4B, whether
rows of a 16-row (and 128-row) bf16 GEMM equal the same rows computed alone or padded to
16, and then the first verify-vs-decode logit difference of the whole model with GEMM rows
computed as they are and padded to 16.

    python -m bench.exactness_probe
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import dflash_serve.layers.linear as linear_module
from dflash_serve.checkpoint.synthetic import QWEN35_4B_TEXT, write_target
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape

GEMM = F.linear  # captured before the padded variant is swapped in below
SHAPES = {  # (out, in) of every distinct linear in Qwen3.5-4B
    "q_proj": (8192, 2560),
    "k_proj": (1024, 2560),
    "o_proj": (2560, 4096),
    "in_proj_qkv": (8192, 2560),
    "in_proj_z": (4096, 2560),
    "in_proj_ab": (32, 2560),
    "out_proj": (2560, 4096),
    "gate_up": (9216, 2560),
    "down": (2560, 9216),
    "head": (248320, 2560),
}


def padded_linear(x: torch.Tensor, weight: torch.Tensor, tile: int = 16) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    padding = -rows.shape[0] % tile
    if padding:
        rows = torch.cat((rows, rows.new_zeros(padding, rows.shape[1])))
    return GEMM(rows, weight)[: x.reshape(-1, x.shape[-1]).shape[0]].reshape(
        *x.shape[:-1], weight.shape[0]
    )


def gemm_rows() -> dict:
    out = {}
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(128, k, device="cuda", dtype=torch.bfloat16)
        full16, full128 = F.linear(x[:16], weight), F.linear(x, weight)
        out[name] = {
            "1_vs_16": bool(torch.equal(F.linear(x[:1], weight), full16[:1])),
            "16_vs_128": bool(torch.equal(full16, full128[:16])),
            "padded1_vs_16": bool(torch.equal(padded_linear(x[:1], weight), full16[:1])),
        }
    return out


def verify_vs_decode(model_dir: Path) -> dict:
    model = load_target_model(model_dir, torch.bfloat16, "cuda")
    prompt = [(i * 31) % 5000 for i in range(64)]
    block = [(i * 97) % 5000 for i in range(16)]
    engine = TargetEngine(model, StateShape(2, 256))
    a, b = engine.open_sequence(), engine.open_sequence()
    engine.prefill(a, prompt)
    engine.prefill(b, prompt)
    block_logits = engine.verify([a], [block]).logits[0]
    decoded = []
    for token in block:
        decoded.append(engine.verify([b], [[token]]).logits[0, 0])
        engine.commit(b, 1)
    decoded = torch.stack(decoded)
    equal_rows = [bool(torch.equal(block_logits[i], decoded[i])) for i in range(16)]
    return {"rows_equal": equal_rows, "max_abs_diff": float((block_logits - decoded).abs().max())}


def main() -> None:
    results = {"gpu": torch.cuda.get_device_name(), "gemm_rows": gemm_rows()}
    print(json.dumps(results["gemm_rows"], indent=1), flush=True)
    model_dir = write_target(Path(tempfile.mkdtemp()) / "t", QWEN35_4B_TEXT, "bf16", device="cuda")
    results["verify_vs_decode"] = verify_vs_decode(model_dir)

    def padded(x, weight, bias=None):
        return padded_linear(x, weight) if bias is None else GEMM(x, weight, bias)

    linear_module.F.linear = padded  # diagnostic only: what padding on the GPU would change
    try:
        results["verify_vs_decode_padded16"] = verify_vs_decode(model_dir)
    finally:
        linear_module.F.linear = GEMM
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
