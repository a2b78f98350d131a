"""The worker's CPU-only code: the C kernels (kernels/, built and loaded by native.py, for
the ISA level cpu_isa.py chooses), their typed wrappers (native_linear.py, native_quant.py,
native_lora.py), the linear kernels (linear_kernels.py, quantized_linears.py), the
cpu-native attention backend (native_attention.py), the one-call decode stack
(decode_stack.py), host-memory tuning (heap.py, huge_pages.py) and the CPU platform
(platform.py). Outside worker/ only tests and the tools that measure its kernels import
it; device-neutral worker code reaches it through the platform.
"""
