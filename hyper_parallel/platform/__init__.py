"""Platform implementations (MindSpore only here)."""
