"""The command line (`python -m pipecheck`): options, `check`, `zoo`."""
