"""The figures `/metrics` serves: queue and job counts, model statistics, SLA histograms."""
