"""The worker: KV tensors, attention, input preparation, the forward pass and sampling."""
