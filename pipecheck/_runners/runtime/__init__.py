"""pipecheck's own distributed runtime as a runner (its rank side is `pipecheck._runtime.executor`)."""
