"""torch.distributed.pipelining as a runner: the driver and the rank step."""
