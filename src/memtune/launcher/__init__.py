"""The job side: one process per run (train.py), never per rank."""
