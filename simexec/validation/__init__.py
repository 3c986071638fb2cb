"""Published data and the readers that hold predictions against it."""
