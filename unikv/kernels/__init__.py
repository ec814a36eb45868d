"""Compute kernels shared by the KV strategies and the engine's layers: the operator registry
with its breaker (`operators`: every op has a reference implementation and faster ones that
must agree with it), the C sources and their builder per ISA (`native`: AVX-512 / AVX2 /
portable, the hybrid attention kernel; `gemv`: packed GGUF matrix-vector products) and the
torch dtypes by name (`dtypes`). Above `settings` (the cache directory), below the strategies.
"""
