"""MindSpore pipeline parallelism (not provided: see :mod:`._utils`)."""
