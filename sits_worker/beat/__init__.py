"""SITS's Celery beat: a scheduler that releases the schedules stored in Redis (`broker/schedules/`)."""
