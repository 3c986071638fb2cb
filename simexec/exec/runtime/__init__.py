"""The Ray runtime: launcher, rank workers, process groups."""
