"""Schedules: jobs released by SITS's beat once per slot of a cron or interval, admitted, chained."""
