"""Measurement: the tracer and live-memory tracking."""
