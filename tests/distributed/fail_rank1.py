"""Launch-failure fixture: rank 1 prints a sentinel and exits 3; rank 0 would run for a minute
(msrun kills it once rank 1 has failed). Imports no MindSpore, so a launch costs ~3 s."""
import os
import sys
import time

SENTINEL = "rank-1-sentinel-4711"

role, rank = os.environ.get("MS_ROLE"), os.environ.get("RANK_ID")
if role == "MS_WORKER" and rank == "1":
    print(f"{SENTINEL}: failing on purpose with exit code 3", flush=True)
    sys.exit(3)
if role == "MS_WORKER":
    time.sleep(60)
