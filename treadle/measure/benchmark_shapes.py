"""The benchmark model's shapes (SmolLM2-135M, which the demo model copies), torch-free.

Owns the constants that the MFU arithmetic (measure/peak.py) and the step floor
(bench/step_floor.py) both price a token with: hidden 576, 9 query heads / 3 KV heads of
64, intermediate 1536, 30 layers, vocabulary 49152, the LM head tied to the embedding.
"""

from __future__ import annotations

HIDDEN, INTERMEDIATE, VOCAB, NUM_LAYERS, HEAD_DIM, NUM_KV_HEADS = 576, 1536, 49152, 30, 64, 3
NUM_HEADS = HIDDEN // HEAD_DIM

#: name -> (in_features, out_features, uses per token).
BENCHMARK_MODEL_SHAPES: dict[str, tuple[int, int, int]] = {
    "q_proj": (HIDDEN, HIDDEN, NUM_LAYERS),
    "k_proj/v_proj": (HIDDEN, NUM_KV_HEADS * HEAD_DIM, 2 * NUM_LAYERS),
    "o_proj": (HIDDEN, HIDDEN, NUM_LAYERS),
    "gate_proj/up_proj": (HIDDEN, INTERMEDIATE, 2 * NUM_LAYERS),
    "down_proj": (INTERMEDIATE, HIDDEN, NUM_LAYERS),
    "lm_head": (HIDDEN, VOCAB, 1),
}

NORM_PARAMETERS = HIDDEN * (2 * NUM_LAYERS + 1)
"""The RMS norms' weights: two per layer and the final one."""


def linear_parameters(with_lm_head: bool = True) -> int:
    """Weights of the linears (the LM head, which is also the embedding, when asked)."""
    return sum(i * o * uses for name, (i, o, uses) in BENCHMARK_MODEL_SHAPES.items()
               if with_lm_head or name != "lm_head")


NUM_PARAMETERS = linear_parameters() + NORM_PARAMETERS
"""Every parameter, the tied embedding once: 134,515,008."""
