"""Online requests: their records, timeouts, queue policy and batching settings."""
