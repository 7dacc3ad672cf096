"""Tools around a run: the tiny demo model, generation, merging."""
