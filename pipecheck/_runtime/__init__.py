"""The runtime layer: the single-process reference (`DetachExecutor`), pipecheck's stage executor, its
communication, recorded boundary values and the timeline. Knows nothing of verdicts."""
