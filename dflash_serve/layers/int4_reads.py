"""What the GPU row kernel reads for a 4-bit layer on verify and decode (no torch import here:
the launcher and the service config name the choices before any model loads).

"bf16": the dequantized weight the layer keeps for prefill anyway (no second copy), through
`row_matmul`; "int4": the packed 4 bits through `w4a16_matmul` (repacked once, more memory).
They round differently (the bf16 copy rounds each (q - z) * s to bf16; the W4A16 kernel
scales exact fp32 group sums), so their outputs differ in the low bits; each is exact in
the sense that matters, rows independent of the batch. bf16 is the default because it was
measured and the W4A16 kernel's verify step was not yet (H200, 2026-12-01,
`bench.tune_w4a16`): per 16-row matmul the W4A16 kernel takes 1.3-1.7x less time, but at
128 rows (8 verify blocks) more for gate+up, down and the output projections.
"""

INT4_READS = ("bf16", "int4")
