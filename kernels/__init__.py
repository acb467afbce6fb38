"""Custom kernels (shared-prompt attention arrives with its own issue)."""
