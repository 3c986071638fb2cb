"""The executor: runs a plan's program for real with torch, one Ray actor per rank (`api.execute`).

Imported only when a real run is asked for, so that `import simexec` stays free of torch and ray."""
