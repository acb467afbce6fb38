"""Custom kernels: shared_prompt/ (one prompt and its K responses as one sequence, exact attention),
fast_layers/ (RoPE, SwiGLU and RMSNorm of the training model in fewer passes)."""
