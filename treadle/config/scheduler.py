"""`SchedulerConfig`: the scheduler's budgets, policy and preemption."""

from __future__ import annotations

from dataclasses import dataclass, field

from treadle.config.values import SCHEDULING_POLICIES, DEFAULT_SCHEDULING_POLICY, _help, parse_tenant_weights

FINISH_SLACK_DIVISOR = 8
"""With finish_prompts_first, a prompt whose rest after this step's chunk would be at most
max_num_batched_tokens / FINISH_SLACK_DIVISOR tokens runs whole, over the budget by that
much (core/step_plan.py, `prompt_chunk`). Gemma 3 270M at 16 streams of 512-token prompts:
the decodes took the budget's last 2-15 tokens, and each prompt's remainder then cost a
step of its own, 16-80 ms each, 5% of the run."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling budgets."""

    max_num_batched_tokens: int = field(default=512, metadata=_help(
        "Token budget of one engine step (prefill chunks plus decodes); LLM (offline) "
        "defaults to 1024. With finish_prompts_first a prompt may pass it by up to 1/8 "
        "to finish in the step"))
    max_num_seqs: int = field(default=128, metadata=_help(
        "Most requests that run in one engine step"))
    enable_chunked_prefill: bool = field(default=True, metadata=_help(
        "Split prompts longer than the remaining budget across steps"))
    preemption_mode: str = field(default="auto", metadata=_help(
        "recompute, swap, or auto (the cheaper per victim by measured costs)"))
    preemption_cooldown_steps: int = field(default=8, metadata=_help(
        "Steps after resuming during which a request is not preempted again if avoidable"))
    victim_priority_weight: float = field(default=1000.0, metadata=_help(
        "Victim loss per priority level, in tokens (docs/scheduling.md)"))
    victim_wait_weight: float = field(default=100.0, metadata=_help(
        "Victim loss per second spent in the engine, in tokens (docs/scheduling.md)"))
    scheduling_policy: str = field(default=DEFAULT_SCHEDULING_POLICY, metadata=_help(
        "Order of waiting requests (docs/scheduling.md): "
        + "; ".join(f"{name}, {line}" for name, line in SCHEDULING_POLICIES.items())))
    makespan_min_rows: int = field(default=12, metadata=_help(
        "makespan policy: the fewest requests it lets run at once while others wait (a "
        "decode step's linears stop waiting on weight reads at about this many rows: with "
        "bf16 SmolLM2-135M on an AVX-512 BF16 CPU, 12 ran 2.5 percent faster than 16, 24 "
        "2-5 percent slower than 16)"))
    priority_aging_rate: float = field(default=0.0, metadata=_help(
        "priority policy: priority levels a request gains per second it waits to run (not while "
        "it runs; 0: none)"))
    priority_aging: float = field(default=0.0, metadata=_help(
        "priority policy: the bound on waiting, as a multiple of the mean wait of recent "
        "requests: a request that has waited that long outranks every priority class "
        "(docs/scheduling.md; 0: off)"))
    decode_step_prefill_tokens: int = field(default=-1, metadata=_help(
        "Most prompt tokens a step that carries decodes runs, so that a streamed answer's "
        "time between tokens stays short (a step without decodes keeps the whole "
        "max_num_batched_tokens): -1, no bound (the default: at low load it costs long "
        "prompts their first token, docs/scheduling.md); 0, auto: what six of a step's "
        "fixed costs buy by the measured step costs (raises the capacity under a p99 TBT "
        "target); N: N tokens"))
    priority_yield: bool = field(default=True, metadata=_help(
        "priority policy: while a request of a more urgent priority class is present (or "
        "was, within batch_yield_window_s), the less urgent classes together take at most "
        "priority_step_tokens of a step, as the batch band does beside interactive traffic"))
    priority_step_tokens: int = field(default=0, metadata=_help(
        "priority policy, with priority_yield: most tokens the less urgent classes take "
        "together in one step while a more urgent class is about (0: auto, what a step's "
        "whole fixed cost buys by the measured step costs)"))
    srpt_aging_rate: float = field(default=10.0, metadata=_help(
        "srpt policy: tokens of remaining work a request sheds per second in the engine (0: none)"))
    tenant_weights: str = field(default="", metadata=_help(
        "fair policy: token-share weights per tenant, e.g. 'a=1,b=3' (unlisted tenants weigh 1)"))
    admission_preemption: bool = field(default=True, metadata=_help(
        "Preempt a running request for a waiting one more urgent by the threshold (not fcfs)"))
    admission_preemption_wait_steps: int = field(default=16, metadata=_help(
        "A more urgent request waits instead of preempting at admission while a running "
        "request will end within this many steps (its remaining max_tokens): that slot "
        "comes sooner than a preemption repays (0: preempt at once)"))
    admission_preemption_threshold: float | None = field(default=None, metadata=_help(
        "Urgency gap needed to preempt at admission, in the policy's unit (levels or tokens); "
        "the policy's default when not given"))
    isolate_urgent_prefill: bool = field(default=True, metadata=_help(
        "priority policy: a step that prefills a request of a more urgent priority class "
        "carries no decodes or prefill chunks of less urgent classes (they run next step)"))
    finish_prompts_first: bool = field(default=True, metadata=_help(
        "A step that finishes a prompt carries no partial chunk of another prompt (it "
        "would delay that first token; it starts next step with the budget first), the "
        "last chunk of a prompt split across steps runs with decodes only, and a prompt "
        "whose rest would be at most 1/8 of max_num_batched_tokens finishes in this step, "
        "over the budget by that much, instead of taking a step of its own"))
    kv_watermark: float = field(default=0.01, metadata=_help(
        "Fraction of the KV blocks an admission leaves free (with the expected growth of "
        "the running requests: admission_lookahead_tokens)"))
    admission_lookahead_tokens: int = field(default=64, metadata=_help(
        "Tokens of growth (up to max_tokens) per running request, and the admitted one, "
        "that an admission must leave room for, so that admitting rarely forces a "
        "preemption (0: admit on free blocks alone)"))
    tenant_kv_share: bool = field(default=False, metadata=_help(
        "While tenants compete, each holds at most its weighted share of the KV cache "
        "(unused share is lent), and memory victims come from tenants over their share"))
    max_preemptions: int = field(default=3, metadata=_help(
        "Preemptions an interactive request may suffer: at this many it is resumed only "
        "when the KV cache can hold it to its end, and is never preempted again (batch "
        "requests yield without bound; 0: never preempt a request, admit only what fits "
        "to the end)"))
    overlap_steps: bool = field(default=False, metadata=_help(
        "Submit the next step to the worker before the outputs of the one just finished "
        "are processed (detokenizing, stop strings, streaming, metrics), so that work runs "
        "beside the next forward pass; uni executor only. Off: on 2 cores it was not "
        "measurably faster (docs/overlap.md)"))
    slo_reject: bool = field(default=False, metadata=_help(
        "slo policy: refuse at once (an error naming the deadline and the predicted first "
        "token) a waiting request that can no longer meet its slo_ttft_ms, instead of "
        "serving it best-effort"))
    batch_step_tokens: int = field(default=0, metadata=_help(
        "Most tokens batch-band requests (Batch API lines) take in one step while "
        "interactive traffic is present, so that steps stay short for interactive "
        "arrivals (0: auto, what a quarter of a step's fixed cost buys by the measured "
        "step costs)"))
    batch_yield_window_s: float = field(default=5.0, metadata=_help(
        "Seconds after the last interactive request during which batch work stays "
        "bounded by batch_step_tokens (then it fills every seat again; an interactive "
        "stream of rate r finds it unbounded with probability exp(-r x window))"))
    max_head_bypasses: int = field(default=16, metadata=_help(
        "Times smaller requests may pass a waiting request that does not fit before it gets "
        "the next opening (0: strict order)"))
    trace: str | None = field(default=None, metadata=_help(
        "Write a per-step JSON-lines trace of which requests ran to this file"))

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError("scheduling_policy must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        if self.makespan_min_rows < 1:
            raise ValueError(f"makespan_min_rows must be >= 1, got {self.makespan_min_rows}")
        for name in ("priority_aging_rate", "srpt_aging_rate", "priority_aging"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if (self.admission_preemption_threshold is not None
                and not self.admission_preemption_threshold > 0):
            raise ValueError("admission_preemption_threshold must be > 0, "
                             f"got {self.admission_preemption_threshold}")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if self.admission_lookahead_tokens < 0:
            raise ValueError("admission_lookahead_tokens must be >= 0, "
                             f"got {self.admission_lookahead_tokens}")
        for name in ("max_head_bypasses", "max_preemptions", "batch_step_tokens",
                     "priority_step_tokens", "batch_yield_window_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.decode_step_prefill_tokens < -1:
            raise ValueError("decode_step_prefill_tokens must be >= -1 (-1: no bound), "
                             f"got {self.decode_step_prefill_tokens}")
        parse_tenant_weights(self.tenant_weights)
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError("preemption_mode must be one of auto, recompute, swap, "
                             f"got {self.preemption_mode!r}")
        for name in ("admission_preemption_wait_steps", "preemption_cooldown_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

    @property
    def finish_slack(self) -> int:
        """Tokens a step may run over max_num_batched_tokens to finish a prompt (one prompt
        a step; 0 without finish_prompts_first)."""
        return self.max_num_batched_tokens // FINISH_SLACK_DIVISOR if self.finish_prompts_first else 0

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step carries: the budget and the finishing slack."""
        return self.max_num_batched_tokens + self.finish_slack


