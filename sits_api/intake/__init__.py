"""Taking work in: jobs and models submitted, online requests queued and answered, tasks sent."""
