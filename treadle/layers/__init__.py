"""What model files are built from: the attention layer and its per-step geometry
(attention.py), rotary embeddings (rotary.py), RMSNorm and the fused-ops seam (norm.py),
the linear layer and its kernel seam (linear.py), the parallel context (parallel.py),
the Megatron tensor-parallel layers with the vocabulary-parallel embedding (tensor_parallel.py),
and the plain-layer view a fused kernel reads (plain_layer.py).

Below models/ and worker/: it imports neither (nor anything of the engine above them).
"""
