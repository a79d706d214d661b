"""MindSpore fully_shard parameters and unit state."""
