"""One rank's interpreter of the program and its pieces (collectives, sharding, pipelines)."""
