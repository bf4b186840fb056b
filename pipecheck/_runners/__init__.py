"""The runners layer: a `Job`, the runner skeleton, and one folder per engine (driver and rank side)."""
