"""Benchmarks users run against the public engine (`treadle bench ...`): offline and
served throughput, static-batching baselines, comparisons with other systems, scheduling
and KV pressure, speculation, LoRA, soak, output quality. The kit they share with the
simulator lives in treadle/measure; micro-benchmarks that reach into the engine's
internals live outside the package, in benchmarks/."""
