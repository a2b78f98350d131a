"""DistServe's analytic model of a prefill/decode fleet at 8 and 64 GPUs (docs/replicas.md).

Zhong et al., "DistServe" (OSDI 2024), section 3: a prefill instance with Poisson arrivals
at rate R and a fixed prefill time D is an M/D/1 queue, so its mean TTFT is
D + R·D² / (2·(1 − R·D)). Decode is batched and memory-bound: a step costs the weights
read once plus each request's KV, and a request's TPOT is that step time. The colocated
alternative runs the same work on every GPU: a decode step that carries a prefill chunk
costs that chunk's compute too, so TPOT of the requests decoding alongside a prompt
grows by the chunk's time (DistServe's "prefill-decoding interference").

D and the step times come from treadle's roofline (treadle/sim/roofline.py: the `h200`
preset and the `llama-3-8b` shape), the prompt and output lengths from the Azure
conversation trace's means (1,155 and 211 tokens). Prints one table per fleet size:
`python benchmarks/pd_scale.py 8:130 64:886` (GPUs:requests per second).
"""

from __future__ import annotations

import sys

from treadle.sim.hardware import load_hardware, load_model_shape
from treadle.sim.roofline import RooflineStepModel, kv_transfer_seconds

PROMPT, OUTPUT = 1155, 211
CHUNK = 512  # the engine's step token budget: a colocated step carries this much prompt


def features(prefill_tokens=0, decode_rows=0, context=0):
    return {"prefill_tokens": prefill_tokens, "decode_tokens": decode_rows,
            "prefill_rows": 1 if prefill_tokens else 0, "decode_rows": decode_rows,
            "decode_context_tokens": decode_rows * context,
            "prefill_attention_pairs": prefill_tokens * prefill_tokens // 2,
            "prefill_context_tokens": 0, "swap_out_bytes": 0, "swap_in_bytes": 0}


def main(argv: list[str] | None = None) -> int:
    """argv: GPUS:RATE pairs (requests/s of the whole fleet), e.g. 8:130 64:886."""
    fleets = [(int(g), float(r)) for g, r in (a.split(":") for a in (argv or ["8:160", "64:1280"]))]
    hw, shape = load_hardware("h200"), load_model_shape("llama-3-8b")
    model = RooflineStepModel(hw, shape)
    d = model.step_seconds(features(prefill_tokens=PROMPT))
    transfer = kv_transfer_seconds(hw, shape, PROMPT)
    context = PROMPT + OUTPUT // 2
    print(f"prefill of {PROMPT} tokens D = {d * 1000:.1f} ms; KV transfer "
          f"{transfer * 1000:.2f} ms ({PROMPT * shape.kv_bytes_per_token / 2**20:.0f} MiB "
          f"over {hw.network_bandwidth * 8 / 1e9:.0f} Gb/s)")
    def decode_tpot(rate_per_replica, prefill_tokens_per_s=0.0):
        """TPOT of a replica decoding at this rate (Little's law fixed point: batch =
        rate x OUTPUT x TPOT), with prompt tokens mixed in when colocated; None when the
        batch runs past max_num_seqs (128: overloaded)."""
        t = model.step_seconds(features(decode_rows=1, context=context))
        for _ in range(200):
            batch = max(1, round(rate_per_replica * OUTPUT * t))
            chunk = min(CHUNK, round(prefill_tokens_per_s * t))
            if batch > 128:
                return None, batch
            t = model.step_seconds(features(prefill_tokens=chunk, decode_rows=batch,
                                            context=context))
        return t, batch

    def md1(rate, service):
        load = rate * service
        return (service + rate * service * service / (2 * (1 - load))) if load < 1 else None

    for gpus, rate in fleets:
        print(f"\n{gpus} GPUs, {rate:.0f} requests/s ({rate / gpus:.1f} per GPU)\n")
        print("| fleet | prefill R·D | mean TTFT (M/D/1) | decode batch | TPOT |")
        print("| --- | --- | --- | --- | --- |")
        rows = []
        for p in range(1, gpus):
            ttft = md1(rate / p, d)
            tpot, batch = decode_tpot(rate / (gpus - p))
            if ttft is not None and tpot is not None:
                rows.append((p, rate / p * d, ttft + transfer, batch, tpot))
        for p, load, ttft, batch, tpot in rows[::max(1, len(rows) // 6)]:
            print(f"| {p} P + {gpus - p} D | {load:.2f} | {ttft * 1000:.0f} ms | {batch} | "
                  f"{tpot * 1000:.1f} ms |")
        # colocated: each GPU decodes its share while its prompts go through in chunks
        tpot, batch = decode_tpot(rate / gpus, rate / gpus * PROMPT)
        mixed = model.step_seconds(features(prefill_tokens=CHUNK, decode_rows=batch,
                                            context=context))
        service = PROMPT / CHUNK * mixed  # a prompt's chunks, each in a step with decodes
        ttft = md1(rate / gpus, service)
        print(f"| {gpus} colocated | {rate / gpus * service:.2f} | "
              f"{'overloaded' if ttft is None else f'{ttft * 1000:.0f} ms'} | {batch} | "
              f"{'overloaded' if tpot is None else f'{tpot * 1000:.1f} ms'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
