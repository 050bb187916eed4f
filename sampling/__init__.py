"""Sampling: logits processing, the sampler, the rejection sampler that verifies drafts, and the
counter-based noise they share. Below the proposers and the model runners, above the Triton kernels
(``specloop.kernels``), which it calls on CUDA."""
