"""What the tools measure with: the kit that the benchmarks (treadle/bench) and the
simulator (treadle/sim) share, so that neither imports the other. Workloads, the HTTP
load generator and its figures (TTFT, TPOT, ITL, goodput), a `treadle serve` launcher,
result reporting, and the machine's matmul and memory probes. Like the tools, it reaches
the engine through its public API only (tests/unit/test_tool_imports.py); it never
decides anything the engine decides."""
