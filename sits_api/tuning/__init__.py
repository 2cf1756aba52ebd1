"""Tuning a model's batching: the sweep that measures settings under load through the intake."""
