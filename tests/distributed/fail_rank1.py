"""Launch-failure fixture: rank 1 prints a sentinel and exits 3 at once, rank 0 would run for two
minutes. Imports no MindSpore, so a launch costs ~3 s.

Rank 1's process outlives its script: a non-daemon thread (as a thread blocked in a collective
would) keeps the interpreter alive for two minutes after ``sys.exit(3)``. So msrun, which only
watches processes end, sees no failure and kills nobody; only the launcher, which reads rank 1's
report (exit code 3 recorded by ``_rank_entry``), can end this launch early."""
import os
import sys
import threading
import time

SENTINEL = "rank-1-sentinel-4711"
HOLD_SECONDS = 120

role, rank = os.environ.get("MS_ROLE"), os.environ.get("RANK_ID")
if role == "MS_WORKER" and rank == "1":
    threading.Thread(target=time.sleep, args=(HOLD_SECONDS,), daemon=False).start()
    print(f"{SENTINEL}: failing on purpose with exit code 3", flush=True)
    sys.exit(3)
if role == "MS_WORKER":
    time.sleep(HOLD_SECONDS)
