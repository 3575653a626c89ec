"""What the GPU row kernel reads for a 4-bit layer on verify and decode (no torch import here:
the launcher and the service config name the choices before any model loads).

"bf16": the dequantized weight the layer keeps for prefill anyway (no second copy); "int4":
the packed 4 bits through the W4A16 kernel (repacked once, more memory). Both rebuild the same
bf16 weight, so either is exact; bf16 is the default because it is faster on the H200 at every
measured size (verify step, batch 1, one command at a7932c2: 4.52 ms against 4.82 through the
W4A16 kernel with 4-bit MLPs, 4.52 against 5.23 with every large linear 4-bit;
`bench/results/latest.json`): the W4A16 tile is instruction-bound (ncu: 9 % of DRAM
bandwidth), so reading a quarter of the bytes does not pay for unpacking them.
"""

INT4_READS = ("bf16", "int4")
