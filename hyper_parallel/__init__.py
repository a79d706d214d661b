"""Upstream-compatible ``fully_shard`` surface built on gradpool."""
