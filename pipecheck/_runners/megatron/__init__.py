"""Megatron Core's pipeline schedules as a runner: the driver and the rank step."""
