"""Core, platform-independent parts of the fully_shard surface."""
