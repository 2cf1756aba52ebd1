"""A worker's upkeep threads: its heartbeat, and the reaper pass that returns expired leases."""
