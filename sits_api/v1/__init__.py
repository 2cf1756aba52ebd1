"""The v1 REST API: one Flask blueprint per resource (health, models, jobs, requests, admin)."""
