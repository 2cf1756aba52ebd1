"""Tenants on a worker: the fair-share order its leases follow, and billing its runs."""
