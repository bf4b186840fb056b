"""Schedules as data: the per-rank action tables, their simulator and generators, torch's schedule classes."""
