"""The program: instructions, schedules, block anatomy, and the lowering of a plan to per-rank lists."""
