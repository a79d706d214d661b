"""What ``gradpool train`` prints about a run: a line per step, then the summary (node 0)."""
from __future__ import annotations

import statistics


def step_printer(total: int):
    """What prints each step's line (and a save's, on its own line) as the run reports it."""
    width = len(str(total))

    def show(record) -> None:
        print(f"step {record.step + 1:>{width}}/{total}  loss {record.loss:.6f}  "
              f"time {record.seconds * 1e3:8.1f} ms  copied {byte_text(record.bytes_copied):>10}  "
              f"copy {record.copy_gbps:6.2f} GB/s  new allocations {record.new_allocations:3d}  "
              f"pool high-water {byte_text(record.high_water_bytes)}  stalls {record.stalls}",
              flush=True)
        if record.saved is not None:       # its own line: the step line keeps its format
            saved = record.saved
            from gradpool.app.checkpoints import background_text, removed_text
            print(f"saved step {saved['step']} to {saved['path']} ({byte_text(saved['bytes'])}, "
                  f"{saved['seconds']:.2f} s{background_text(saved)}){removed_text(saved)}",
                  flush=True)
    return show


MAX_RANK_LINES = 16        # the summary lists this many ranks one by one, then a range


def print_summary(result) -> None:
    """The run's summary: step times, copies, every rank's pool, launch mode, checkpoints."""
    records = result.records
    times = [r.seconds for r in records]
    later = times[1:]
    after_first = sum(r.new_allocations for r in records[1:])
    outcome = result.outcome
    first = records[0].step + 1 if records else 1      # a resumed run starts after its step
    which = f" (steps {first}-{records[-1].step + 1})" if first > 1 else ""
    print(f"summary: {len(records)} steps{which}, mean step time "
          f"{statistics.fmean(times) * 1e3:.1f} ms"
          + (f" ({statistics.fmean(later) * 1e3:.1f} ms after step {first})" if later else "")
          + f", copied {byte_text(sum(r.bytes_copied for r in records))} in total, "
          f"{after_first} new allocations after step {first}, "
          f"pool high-water {byte_text(max((r.high_water_bytes for r in records), default=0))}")
    ranks = (result.job or {}).get("ranks", [])
    if len(ranks) > 1:
        nodes = result.job["nodes"]
        print(f"ranks: {len(ranks)} on {nodes} node(s), every one ok")
        for info in ranks[:MAX_RANK_LINES]:
            print(f"  rank {info['rank']} (node {info['node']}): {info['steps']} steps, pool "
                  f"high-water {byte_text(info['high_water_bytes'])}, copied "
                  f"{byte_text(info['bytes_copied'])}, {info['new_allocations']} allocations "
                  f"({info['reuses']} reuses), stalls {info['stalls']}, "
                  f"{info['verified_gradients']} gradients verified")
        if len(ranks) > MAX_RANK_LINES:
            high = [r["high_water_bytes"] for r in ranks]
            print(f"  ... {len(ranks) - MAX_RANK_LINES} more; pool high-water from "
                  f"{byte_text(min(high))} to {byte_text(max(high))}")
    blocking = [bool(r["launch_blocking"]) for r in ranks] if len(ranks) > 1 else \
        [outcome.launch_blocking]
    mode = "blocking" if all(blocking) else "asynchronous" if not any(blocking) else \
        f"blocking on ranks {[i for i, b in enumerate(blocking) if b]}, asynchronous elsewhere"
    print(f"op launch: {mode} ({len(blocking)} rank(s); launch.launch_blocking)")
    if outcome.verify_gradients:
        if len(ranks) > 1:
            print(f"gradient integrity: {sum(r['verified_gradients'] for r in ranks)} gradients "
                  f"verified unchanged after their reduce path (all {len(ranks)} ranks)")
        else:
            print(f"gradient integrity: {outcome.verified_gradients} gradients verified "
                  f"unchanged after their reduce path (rank 0)")
    else:
        print("gradient integrity: not verified (gradpool.verify_gradients is false)")
    print_checkpoints(outcome, len(ranks) or 1)


def print_checkpoints(outcome, world: int) -> None:
    """What the run loaded and saved (rank 0's view: sizes are every rank's together)."""
    resumed = outcome.resumed
    if resumed is not None:
        print(f"resumed from {resumed['path']} at step {resumed['step']} (saved at "
              f"{resumed['world_size']} rank(s)): {byte_text(resumed['job_bytes_read'])} read by "
              f"{world} rank(s), {resumed['job_seconds']:.2f} s")
    saved = outcome.saved
    if saved:
        plural = "s" if len(saved) > 1 else ""
        print(f"saved {len(saved)} checkpoint{plural} (step{plural} "
              f"{', '.join(str(s['step']) for s in saved)}): "
              f"{byte_text(sum(s['bytes'] for s in saved))}, "
              f"{sum(s['seconds'] for s in saved):.2f} s in all"
              + (f" (training blocked {sum(s['blocked_seconds'] for s in saved):.2f} s: "
                 "train.async_save)" if any(s.get("asynchronous") for s in saved) else "")
              + f"; the last is {saved[-1]['path']}")


def byte_text(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
