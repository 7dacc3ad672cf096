"""The per-rank memory planner: counts (meta-device model), estimate (pure), fit (decisions)."""
