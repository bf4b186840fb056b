"""The implementation of :mod:`pipecheck.strategies`; import from there instead."""
