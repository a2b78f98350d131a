"""The profiling step: one forward pass at the largest step the scheduler can make.

Run at start-up before the KV cache exists, so that the platform can measure the peak of
the activations (on a GPU the KV cache gets what is left under --gpu-memory-utilization:
Platform.kv_cache_bytes). The largest step is max_step_tokens of prompt (the budget and
the slack a finishing prompt may take, SchedulerConfig.max_step_tokens) over as
many rows as max_num_seqs allows (every row sampling, so the logits of all of them are
counted too), each row within max_model_len. It runs on a KV cache of its own, just big
enough, through a model runner of its own, both dropped afterwards; the requests are
finished at once, so nothing of them stays in the runner's state.
"""

from __future__ import annotations

from treadle.core.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from treadle.sampling_params import SamplingParams


def profile_lengths(max_step_tokens: int, max_num_seqs: int,
                    max_model_len: int) -> list[int]:
    """Prompt tokens per row of the largest step (their sum is the step's tokens)."""
    rows = max(1, min(max_num_seqs, max_step_tokens))
    base, extra = divmod(max_step_tokens, rows)
    return [min(max_model_len, base + (i < extra)) for i in range(rows) if base + (i < extra)]


def profile_steps(lengths: list[int], block_size: int,
                  vocab_size: int) -> tuple[SchedulerOutput, SchedulerOutput, int]:
    """(the step, the step that finishes its requests, the KV blocks it needs)."""
    scheduled, next_block = [], 0
    for i, length in enumerate(lengths):
        num_blocks = -(-length // block_size)
        prompt = [(7 * i + j) % vocab_size for j in range(length)]
        scheduled.append(ScheduledRequest(
            request_id=f"profile-{i}", num_computed_tokens=0, num_scheduled_tokens=length,
            new_block_ids=list(range(next_block, next_block + num_blocks)), sample=True,
            new_request=NewRequestData(prompt, SamplingParams(max_tokens=1))))
        next_block += num_blocks
    ids = [s.request_id for s in scheduled]
    return (SchedulerOutput(scheduled=scheduled),
            SchedulerOutput(scheduled=[], finished_request_ids=ids), next_block)
