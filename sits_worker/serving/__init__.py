"""Serving leased work: the drain loop, leasing, chunk and request runs, outputs, the profiler."""
