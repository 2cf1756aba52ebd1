"""Registered model versions, their per-process cache, and A/B routes from a bare name to a version."""
