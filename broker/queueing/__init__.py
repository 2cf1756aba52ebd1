"""The ready queues: priority scores, the live policy, leases and tickets, wake-ups, worker heartbeats."""
