"""The capacity simulator: treadle's own Scheduler and KV manager on a simulated clock, a
step-time model instead of a model runner, replicas behind a router (colocated or
prefill/decode), and a search for the smallest fleet that meets an SLO (docs/simulator.md).
No torch here (the hardware probe imports it lazily)."""
