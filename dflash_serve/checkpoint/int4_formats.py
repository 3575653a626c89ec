"""4-bit linear weights as AutoAWQ (GEMM) and compressed-tensors (pack-quantized) store them.

The packed tensors stay exactly as read so a GPU kernel can use them without a repack;
`dequantize` is the plain fp32 reference kernels are tested against. The pack functions
build small test checkpoints with the real on-disk conventions (AutoAWQ
awq/modules/linear/gemm.py, compressed-tensors pack_quantized.py). N outputs, K inputs,
group g:
- AWQ GEMM: qweight int32 [K, N/8], qzeros int32 [K/g, N/8], scales fp16 [K/g, N]; nibble i
  (bits 4i..4i+3) of word j holds column 8j + AWQ_COLUMN_OF_NIBBLE[i]; W = (q - z) * s.
- compressed-tensors: weight_packed int32 [N, ceil(K/8)], nibble i of word j holds input
  8j + i; weight_scale [N, K/g] in the model dtype; asymmetric adds weight_zero_point int32
  [ceil(N/8), K/g] packed along N. Signed values are stored + 8: W = (u - 8) * s or
  (u - u_zero) * s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from dflash_serve.errors import CheckpointError

AWQ_GEMM = "awq_gemm"
COMPRESSED_TENSORS = "compressed_tensors"
NIBBLES_PER_WORD = 8
AWQ_COLUMN_OF_NIBBLE = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_NIBBLE_OF_COLUMN = [0, 4, 1, 5, 2, 6, 3, 7]
CT_OFFSET = 8
INT32 = (torch.int32,)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PackedInt4Weight:
    """A 4-bit linear weight in its stored layout (the source of truth for GPU kernels)."""

    format: str
    out_features: int
    in_features: int
    group_size: int
    tensors: dict[str, torch.Tensor]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K]: (q - z) * s is exact in fp32, so only the final cast rounds."""
        return _dequantize(self).to(dtype)


def _unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, W] -> int64 [R, W, 8], nibble i at index i (the mask drops sign bits)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=words.device)
    return (words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF


def _pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] in [0, 15] -> int32 [R, ceil(C/8)]: value c in nibble c % 8 of word c // 8."""
    padded = torch.nn.functional.pad(values.to(torch.int64), (0, -values.shape[1] % 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (padded.reshape(values.shape[0], -1, NIBBLES_PER_WORD) << shifts).sum(-1)
    # A top nibble >= 8 overflows int32: keep the bits, as two's complement.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(packed: PackedInt4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Either format as (q int64 [K, N], zeros int64 [K/g, N], scales [K/g, N] as stored):
    W[n, k] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n]."""
    tensors, n, k = packed.tensors, packed.out_features, packed.in_features
    if packed.format == AWQ_GEMM:
        q = _unpack_nibbles(tensors["qweight"])[..., AWQ_NIBBLE_OF_COLUMN].flatten(1)
        zeros = _unpack_nibbles(tensors["qzeros"])[..., AWQ_NIBBLE_OF_COLUMN].flatten(1)
        return q, zeros, tensors["scales"]
    if packed.format == COMPRESSED_TENSORS:
        q = _unpack_nibbles(tensors["weight_packed"]).flatten(1)[:, :k].t()
        if "weight_zero_point" in tensors:
            zeros = _unpack_nibbles(tensors["weight_zero_point"].t()).flatten(1)[:, :n]
        else:
            zeros = torch.full((k // packed.group_size, n), CT_OFFSET, device=q.device)
        return q, zeros, tensors["weight_scale"].t()
    raise ValueError(f"packed: unknown format {packed.format!r}")


def _dequantize(packed: PackedInt4Weight) -> torch.Tensor:
    q, zeros, scales = unpack_int4(packed)
    zeros = zeros.repeat_interleave(packed.group_size, dim=0)
    scales = scales.float().repeat_interleave(packed.group_size, dim=0)
    return ((q - zeros).float() * scales).t().contiguous()


def detect_linear_format(reader, prefix: str) -> str:
    """How a linear is stored, decided from the tensors present (never from ignore lists)."""
    for suffix, fmt in (("weight", "dense"), ("qweight", AWQ_GEMM)):
        if reader.has(prefix + suffix):
            return fmt
    if reader.has(prefix + "weight_packed"):
        return COMPRESSED_TENSORS
    raise CheckpointError(f"{prefix}: no weight, qweight or weight_packed tensor")


def read_int4_weight(
    reader,
    prefix: str,
    fmt: str,
    quantization: dict | None,
    out_features: int,
    in_features: int,
) -> PackedInt4Weight:
    """Read one 4-bit linear, checking every tensor against [out_features, in_features].

    The group size comes from `quantization` (config.json's quantization_config) and must
    match the scales; without a config it is inferred from the scales. A missing or
    inconsistent tensor raises CheckpointError naming the full tensor name.
    """
    n, k = out_features, in_features
    if fmt == AWQ_GEMM:
        group_size = None if quantization is None else _awq_group_size(quantization, k)
        return _read_awq(reader, prefix, n, k, group_size)
    if fmt == COMPRESSED_TENSORS:
        return _read_ct(reader, prefix, n, k, quantization)
    raise ValueError(f"fmt: expected awq_gemm or compressed_tensors, got {fmt!r}")


def _read_awq(reader, prefix: str, n: int, k: int, group_size: int | None):
    _require(reader, prefix, ("qweight", "qzeros", "scales"), AWQ_GEMM)
    if n % NIBBLES_PER_WORD:
        raise CheckpointError(f"{prefix}qweight: out_features {n} is not a multiple of 8")
    group_size = _group_size(reader, prefix + "scales", 0, k, group_size)
    num_groups, num_words = k // group_size, n // NIBBLES_PER_WORD
    # Scales first: a group size that disagrees with the config shows up there.
    specs = {
        "scales": ((num_groups, n), SCALE_DTYPES),
        "qweight": ((k, num_words), INT32),
        "qzeros": ((num_groups, num_words), INT32),
    }
    tensors = {key: _read_checked(reader, prefix + key, *specs[key]) for key in specs}
    return PackedInt4Weight(AWQ_GEMM, n, k, group_size, tensors)


def _read_ct(reader, prefix: str, n: int, k: int, quantization: dict | None):
    _require(reader, prefix, ("weight_packed", "weight_scale"), COMPRESSED_TENSORS)
    if reader.has(prefix + "weight_g_idx"):
        raise CheckpointError(f"{prefix}weight_g_idx: act-order groups unsupported")
    has_zero_point = reader.has(prefix + "weight_zero_point")
    group_size = None
    if quantization is not None:
        group_size, is_symmetric = _ct_group_args(quantization, prefix.rstrip("."), k)
        if is_symmetric == has_zero_point:
            state = "present" if has_zero_point else "missing"
            message = f"{state}, but config symmetric={is_symmetric}"
            raise CheckpointError(f"{prefix}weight_zero_point: {message}")
    group_size = _group_size(reader, prefix + "weight_scale", 1, k, group_size)
    num_groups = k // group_size
    specs = {
        "weight_scale": ((n, num_groups), SCALE_DTYPES),
        "weight_packed": ((n, -(-k // 8)), INT32),
        "weight_zero_point": ((-(-n // 8), num_groups), INT32),
    }
    if not has_zero_point:
        del specs["weight_zero_point"]
    tensors = {key: _read_checked(reader, prefix + key, *specs[key]) for key in specs}
    if reader.has(prefix + "weight_shape"):
        name = prefix + "weight_shape"
        stored = _read_checked(reader, name, (2,), (torch.int32, torch.int64)).tolist()
        if stored != [n, k]:
            raise CheckpointError(f"{name}: expected [{n}, {k}], found {stored}")
    return PackedInt4Weight(COMPRESSED_TENSORS, n, k, group_size, tensors)


def _require(reader, prefix: str, suffixes: tuple[str, ...], fmt: str) -> None:
    for suffix in suffixes:
        if not reader.has(prefix + suffix):
            raise CheckpointError(f"{prefix}{suffix}: missing ({fmt} needs it)")


def _awq_group_size(quantization: dict, k: int) -> int | None:
    """Check the fields AutoAWQ writes; group_size -1 means one group over all of K."""
    required = {"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True}
    for key, expected in required.items():
        found = quantization.get(key, expected)
        if (found.lower() if isinstance(found, str) else found) != expected:
            message = f"expected {expected!r}, found {found!r}"
            raise CheckpointError(f"quantization_config.{key}: {message}")
    group_size = quantization.get("group_size")
    return k if group_size == -1 else group_size


def _ct_group_args(quantization: dict, name: str, k: int) -> tuple[int | None, bool]:
    """Group size and symmetry of the first config group whose targets match `name`.

    Matching follows compressed-tensors: "Linear" (a class name) matches every linear,
    "re:<pattern>" is re.match on the module name, any other target must equal the name.
    """
    for group_name, group in (quantization.get("config_groups") or {}).items():
        args = group.get("weights") if isinstance(group, dict) else None
        targets = group.get("targets", []) if args else []
        if not any(_ct_target_matches(target, name) for target in targets):
            continue
        where = f"quantization_config.config_groups.{group_name}.weights"
        if args.get("num_bits") != 4 or args.get("type", "int") != "int":
            raise CheckpointError(f"{where}: expected int 4-bit for {name}, got {args}")
        if args.get("strategy") not in ("group", "channel"):
            raise CheckpointError(f"{where}: expected group or channel, got {args}")
        group_size = k if args["strategy"] == "channel" else args.get("group_size")
        return group_size, bool(args.get("symmetric", True))
    raise CheckpointError(f"{name}: 4-bit, but no quantization_config group targets it")


def _ct_target_matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in ("Linear", name)


def _group_size(reader, scales_name: str, dim: int, k: int, configured: int | None):
    """The configured group size, or else K over the number of groups the scales hold."""
    if configured is not None:
        if configured <= 0 or k % configured:
            raise CheckpointError(f"{scales_name}: group_size {configured} must divide K={k}")
        return configured
    shape = tuple(reader.shape(scales_name))
    num_groups = shape[dim] if len(shape) == 2 else 0
    if num_groups <= 0 or k % num_groups:
        raise CheckpointError(f"{scales_name}: no group size fits K={k}, {shape}")
    return k // num_groups


def _read_checked(reader, name: str, shape: tuple, dtypes: tuple) -> torch.Tensor:
    actual = tuple(reader.shape(name))
    if actual != shape:
        raise CheckpointError(f"{name}: expected shape {shape}, found {actual}")
    tensor = reader.read(name)
    if tensor.dtype not in dtypes:
        expected = " or ".join(map(str, dtypes))
        raise CheckpointError(f"{name}: expected {expected}, found {tensor.dtype}")
    return tensor


def _scales_rounded_up(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast to the storage dtype rounding up, so clamping never costs over half a step."""
    stored = scales.to(dtype)
    bumped = torch.nextafter(stored, torch.full_like(stored, float("inf")))
    return torch.where(stored.float() < scales, bumped, stored)


def _grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """float [N, K] -> fp32 [N, K/g, g], checking the arguments."""
    if weight.ndim != 2 or not weight.is_floating_point():
        raise ValueError(f"weight: expected 2-D float, got {weight.dtype}")
    n, k = weight.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size: expected a divisor of K={k}, got {group_size}")
    return weight.float().reshape(n, k // group_size, group_size)


def pack_awq_gemm(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Quantize float [N, K] like AutoAWQ (asymmetric min-max per group along K) and pack.

    Returns qweight int32 [K, N/8], qzeros int32 [K/g, N/8], scales fp16 [K/g, N]. As in
    AutoAWQ the range is not widened to include zero (a group of one sign clips); unlike
    AutoAWQ the fp16 scale is rounded up, not to nearest.
    """
    grouped = _grouped(weight, group_size)
    if weight.shape[0] % NIBBLES_PER_WORD:
        raise ValueError(f"weight: AWQ needs N % 8 == 0, got {weight.shape[0]}")
    low, high = grouped.amin(-1), grouped.amax(-1)
    scales = _scales_rounded_up((high - low).clamp(min=1e-5) / 15, torch.float16)
    zeros = (-torch.round(low / scales.float())).clamp(0, 15)
    q = torch.round(grouped / scales.float()[..., None]) + zeros[..., None]
    q = q.clamp(0, 15)

    def pack_columns(values: torch.Tensor) -> torch.Tensor:
        by_word = values.reshape(values.shape[0], -1, NIBBLES_PER_WORD)
        return _pack_nibbles(by_word[..., AWQ_COLUMN_OF_NIBBLE].flatten(1))

    return {
        "qweight": pack_columns(q.reshape(weight.shape).t()),
        "qzeros": pack_columns(zeros.t()),
        "scales": scales.t().contiguous(),
    }


def pack_compressed_tensors(
    weight: torch.Tensor, group_size: int, symmetric: bool
) -> dict[str, torch.Tensor]:
    """Quantize float [N, K] like compressed-tensors int4 group quantization, pack-quantized.

    The range always includes zero; scales take the weight dtype if it is fp16/bf16 (as
    llm-compressor does), else bf16, rounded up. Returns weight_packed int32 [N, ceil(K/8)],
    weight_scale [N, K/g], weight_shape int64 [2] and, if asymmetric, weight_zero_point int32
    [ceil(N/8), K/g]; every stored nibble is the signed value + 8.
    """
    grouped = _grouped(weight, group_size)
    is_half = weight.dtype in (torch.float16, torch.bfloat16)
    scale_dtype = weight.dtype if is_half else torch.bfloat16
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    eps = torch.finfo(torch.float32).eps
    if symmetric:
        absmax = torch.maximum(-low, high)
        scales = _scales_rounded_up((absmax / 7.5).clamp(min=eps), scale_dtype)
        zeros = torch.zeros_like(low)
    else:
        scales = _scales_rounded_up(((high - low) / 15).clamp(min=eps), scale_dtype)
        zeros = torch.round(-8 - low / scales.float()).clamp(-8, 7)
    q = (grouped / scales.float()[..., None] + zeros[..., None]).clamp(-8, 7).round()
    packed = {
        "weight_packed": _pack_nibbles(q.reshape(weight.shape) + CT_OFFSET),
        "weight_scale": scales,
        "weight_shape": torch.tensor(weight.shape, dtype=torch.int64),
    }
    if not symmetric:
        zero_point = _pack_nibbles(zeros.t() + CT_OFFSET).t().contiguous()
        packed["weight_zero_point"] = zero_point
    return packed


def awq_quantization_config(group_size: int) -> dict:
    """The quantization_config block AutoAWQ writes into config.json for a GEMM export."""
    return {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group_size,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }


def compressed_tensors_quantization_config(group_size: int, symmetric: bool) -> dict:
    """The quantization_config block llm-compressor writes for int4 W4A16 pack-quantized."""
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "dynamic": False}
    weights |= {"strategy": "group", "group_size": group_size, "actorder": None}
    weights |= {"block_structure": None, "observer": "minmax", "observer_kwargs": {}}
    group = {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}
    group |= {"input_activations": None, "output_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }
