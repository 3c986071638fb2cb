"""Plan search: the space, lower bounds, runners, and the report."""
