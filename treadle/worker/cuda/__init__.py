"""The worker's CUDA-only code: the Triton kernels (triton/) and their attention backend
(triton_attention.py, also run on the CPU under TRITON_INTERPRET=1 for tests), decode
steps replayed from CUDA graphs (cuda_graphs.py, decode_graphs.py), the GPU's memory and
graph-size arithmetic (cuda_support.py), the plain-torch oracle of the Triton kernels
(attention_reference.py) and the CUDA platform (platform.py). Device-neutral worker code
reaches it through the platform.
"""
