"""The split layer: markers, tracing (fx or torch.export), partitioning into a `Pipe`. Knows nothing of processes or verdicts."""
