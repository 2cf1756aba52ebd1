"""Tenants: API keys, tenant records and settings, shares of the fleet, and what each tenant used."""
