"""Self-tuning: the latency/throughput front a model's batching is picked from, and the loops that move
batching and CP-Score weights from live figures."""
