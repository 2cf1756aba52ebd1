"""Failures by class: the retry matrix, circuit breakers, degrade steps, fault injection, quarantine."""
