"""Inference benchmark: measured KV bytes, decode latency, peak memory and capacity of MHA vs MLA,
plus an attention-only microbenchmark against the bytes-ratio bound. Run `python -m mha2mla_exp.bench`."""
