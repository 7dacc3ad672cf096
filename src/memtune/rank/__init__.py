"""The rank side: one process per GPU (or CPU rank), started by the launcher."""
