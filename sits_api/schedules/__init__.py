"""Schedules at the API's edge: their resources, and the releaser that makes each slot's job."""
