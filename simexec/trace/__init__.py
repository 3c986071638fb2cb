"""Traces: the shared event schema, op-by-op comparison, and plots."""
