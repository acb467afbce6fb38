"""Custom kernels: shared_prompt/ (one prompt and its K responses as one sequence, exact attention)."""
