"""The attention-backend interface (base.py) and the device-neutral backends: `torch`
(torch_backend.py) and `reference` (reference.py, the oracle). The device-specific
backends live with their device (worker/cpu/native_attention.py,
worker/cuda/triton_attention.py); the choice among all of them is
worker/attention_backends.py.
"""
