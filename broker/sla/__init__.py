"""Deadlines: admission, the violation predictor and watch, and schedulability of periodic task sets."""
