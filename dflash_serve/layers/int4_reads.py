"""What the GPU row kernel reads for a 4-bit layer on verify and decode (no torch import here:
the launcher and the service config name the choices before any model loads).

"int4" (the default): the packed 4 bits through `w4a16_matmul`, repacked once at load (the
packed copy costs 0.5 bytes a weight more, beside the bf16 copy that prefill reads);
"bf16": the dequantized weight the layer keeps for prefill anyway, through `row_matmul`.
They round differently (the bf16 copy rounds each (q - z) * s to bf16; the W4A16 kernel
scales exact fp32 group sums), so their outputs differ in the low bits; each is exact in the
sense that matters, rows independent of the batch.

Why "int4" is the default (H200, 2026-12-04): replaying the verify graph (one machine, old
and new alternated), one verify block takes 2.75 against 3.81 ms with every large linear
4-bit and 3.37 against 3.95 ms with 4-bit MLPs, while 8 blocks take 6.43 against 5.79 ms
(every large linear 4-bit). Single-stream latency, which the AdaptFM workload measures, gains
more than an 8-stream batch loses; a deployment that serves mostly full batches may prefer
`--int4-reads bf16`. Through the services, in one command: the AdaptFM workload 147 / 365 /
589 against 192 / 476 / 693 ms (bench/results/int4-reads-e2e-2026-12-04-nvidia-h200.json);
bf16 first on 2026-12-05, 137 / 349 / 582 against 154 / 362 / 593 ms and 8 streams 2369
against 2289 tok/s (int4-reads-e2e-2026-12-05-nvidia-h200.json).
"""

INT4_READS = ("int4", "bf16")

# What prefill forwards read (`--prefill-int4-reads`; `reading_bf16_copies`): the bf16 copy by
# default, whatever verify and decode read. Prefill's calls have more rows than a verify's,
# where the W4A16 kernel, which unpacks every weight again for each tile of rows, is the
# slower one; prefill's bits need only agree among prefills, which all read the same.
PREFILL_INT4_READS_DEFAULT = "bf16"


def check_int4_reads(int4_reads: str, prefill_int4_reads: str) -> None:
    """ValueError unless both are choices of INT4_READS and prefill's packed reads have a
    packed copy to read (none is made when verify reads the bf16 copy)."""
    for name, value in (("int4_reads", int4_reads), ("prefill_int4_reads", prefill_int4_reads)):
        if value not in INT4_READS:
            raise ValueError(f"{name} must be one of {INT4_READS}, got {value!r}")
    if prefill_int4_reads == "int4" and int4_reads == "bf16":
        raise ValueError(
            "prefill_int4_reads 'int4' needs int4_reads 'int4': with int4_reads 'bf16' no "
            "packed copy is made, so prefill reads the bf16 copy too"
        )
