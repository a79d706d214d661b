"""MindSpore implementation of the fully_shard reduce path, built on gradpool."""
