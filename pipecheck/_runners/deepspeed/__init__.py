"""DeepSpeed's pipeline engine as a runner: the driver, the rank step, the split as a layer list."""
