"""Device memory: the reservation ledger, graph-aware backfill, and the out-of-memory batch ceiling."""
