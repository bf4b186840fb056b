"""torchtitan's pipeline as a runner: the driver and the rank step."""
