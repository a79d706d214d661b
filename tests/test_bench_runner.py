"""The benchmark runner (quick sweep, CPU, one process) and its report: JSON, Markdown, PNG."""
from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import report, runner
from benchmarks.__main__ import main as benchmarks_main
from benchmarks.cases import REDUCE_METHODS, SMALL_COUNT
from benchmarks.suites import QUICK

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMMAND = "python -m benchmarks run --device CPU --nproc 1 --quick (test)"


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    returned = runner.run(runner.RunOptions(device="CPU", nproc=1, out=out, quick=True,
                                            progress=False, command=COMMAND))
    return out, returned


def test_json_structure(quick_results):
    out, returned = quick_results
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(returned))
    assert data["schema"] == runner.SCHEMA and data["command"] == COMMAND
    machine = data["machine"]
    for key in ("cpu_model", "cores", "mindspore", "numpy", "ml_dtypes", "python", "device",
                "git_commit", "caches"):
        assert machine[key], key
    from gradpool.host import kernels
    assert machine["stream_thresholds"]["copy_from_bytes"] == kernels.COPY_STREAM_FROM_BYTES
    assert machine["stream_thresholds"]["cast_from_bytes"] == kernels.STREAM_FROM_BYTES
    assert len(machine["git_commit"]) == 40 and isinstance(machine["git_dirty"], bool)
    assert machine["device"] == "CPU" and machine["world_size"] == 1
    assert data["options"]["quick"] is True and data["options"]["nproc"] == 1

    cases = data["copy"]["cases"]
    assert {c["nbytes"] for c in cases if c["count"] == 1} == set(QUICK.copy_sizes)
    assert {c["method"] for c in cases} == {"pool", "zero_copy", "fresh_alloc", "memcpy"}
    assert any(c["count"] == SMALL_COUNT for c in cases)
    for case in cases:
        assert 0 < case["min_s"] <= case["q1_s"] <= case["median_s"] <= case["q3_s"] \
            <= case["max_s"]
        assert case["iqr_s"] == pytest.approx(case["q3_s"] - case["q1_s"])
        assert case["stddev_s"] >= 0 and case["min_s"] <= case["mean_s"] <= case["max_s"]
        assert case["rounds"] == case["repeats"] >= QUICK.copy_budget.min_repeats
        assert case["verified"] is True, case["name"]
    assert data["copy"]["small_op"]["median_s"] > 0

    reduce = data["reduce"]
    assert {(r["method"], r["comm_fusion"]) for r in reduce} == {
        (m, f) for m in REDUCE_METHODS for f in (False, True)}
    for row in reduce:
        assert row["world_size"] == 1 and row["communicator"] == "SingleProcessCommunicator"
        assert row["op_launch"] == "async"          # the local suites keep MindSpore's default
        assert row["new_allocations_first_step"] > 0
        assert row["new_allocations_after_first"] == 0, row
        assert row["high_water_bytes"] > 0 and row["live_leases_after"] == 0
        assert row["repeats"] == row["rounds"] == (
            QUICK.fused_reduce_repeats if row["comm_fusion"] else QUICK.reduce_repeats)
        assert row["min_s"] <= row["median_s"] <= row["max_s"] and row["iqr_s"] >= 0
        assert row["verified"] is True
    assert data["reduce_profile"] == []         # one process: no ranks to profile
    borrowed = {(r["method"], r["comm_fusion"]): r["borrows_per_step"] for r in reduce}
    assert borrowed[("zero_copy", False)] == reduce[0]["gradients"]   # world 1: all borrowed
    assert borrowed[("pool", False)] == borrowed[("pool", True)] == 0

    summary = data["summary"]
    assert {(r["world_size"], r["comm_fusion"]) for r in summary["reduce_ratios"]} == {
        (1, False), (1, True)}
    f32 = summary["copy_by_pair"]["float32->float32"]
    assert set(f32["speed_vs_memcpy_from_1MiB"]) == {"1 MiB"}
    assert f32["fused_pack_gradients"] == SMALL_COUNT
    assert f32["fused_pack_speed_vs_small_op"] > 0
    assert 0 < f32["pack_4KiB_us"]["min"] <= f32["pack_4KiB_us"]["median"]
    # one direction for every ratio: reference time / pool time, with its IQR range
    for row in summary["copy_rows"]:
        for ratio in row["ratios"].values():
            assert 0 < ratio["low"] <= ratio["median"] <= ratio["high"]
        memcpy = row["ratios"]["speed_vs_memcpy"]
        times = row["timings"]
        assert memcpy["median"] == pytest.approx(times["memcpy"]["median_s"]
                                                 / times["pool"]["median_s"])
    for ratio in summary["reduce_ratios"]:
        r = ratio["speed_vs_zero_copy"]
        assert r["median"] == pytest.approx(ratio["zero_copy_s"] / ratio["pool_s"])


def test_report_writes_markdown_and_png(quick_results, tmp_path):
    out, _ = quick_results
    written = report.write_report(out, tmp_path / "report")
    md, png = written
    assert md.name == "quick.md" and png.suffix == ".png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    text = md.read_text()
    assert COMMAND in text and "MindSpore 2.10" in text and "cores" in text
    machine = json.loads(out.read_text())["machine"]
    assert f"- Machine: {machine['cpu_model']}, " in text
    assert f"; caches {machine['caches']}; host copies stream from " in text
    assert f"]({png.name})" in text
    for heading in ("## Copy-in of one gradient", "## Fixed cost per call",
                    "## Many small gradients", "## Reduce step"):
        assert heading in text
    assert "| float32 -> float32 | 1 MiB |" in text
    assert "higher is better" in text and "IQR" in text and "ml-dtypes" in text
    assert "reduce steps: 1 warm-up + 3 timed (4 with comm_fusion)" in text


def test_report_command_line(quick_results, tmp_path, capsys):
    out, _ = quick_results
    assert benchmarks_main(["report", str(out), "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "quick.md").is_file()
    assert benchmarks_main(["report", str(tmp_path / "missing.json")]) == 1
    assert benchmarks_main([]) == 2
    assert "usage" in capsys.readouterr().err


def test_bad_options_are_refused():
    with pytest.raises(runner.BenchmarkError, match="suites"):
        runner.RunOptions(suites=("copy", "nope"))
    with pytest.raises(runner.BenchmarkError, match="nproc"):
        runner.RunOptions(nproc=0)


def test_distributed_rows_come_back_in_rank_0s_report(tmp_path, monkeypatch):
    """``_launch_ranks`` reads the rows ``_run_as_rank`` publishes in its rank report. A fake
    ``run_ranks`` stands in for msrun: it runs rank 0 of 2 in this process, in the environment
    ``gradpool.launch`` gives a rank (the real launch is covered by the distributed suites)."""
    import benchmarks.suites
    import gradpool.comm
    import gradpool.device
    from gradpool.app import launch, rank_report

    import benchmarks.phase_profile
    rows = [{"method": "pool", "world_size": 2, "comm_fusion": False}]
    profile = {"rank": 0, "world_size": 2, "phases": {}}
    monkeypatch.setattr(gradpool.comm, "init_distributed", lambda: (0, 2))
    monkeypatch.setattr(gradpool.comm, "communicator_for", lambda *args, **kwargs: "comm")
    monkeypatch.setattr(benchmarks.suites, "run_reduce_suite", lambda *args: list(rows))
    monkeypatch.setattr(benchmarks.phase_profile, "profile_fused_step",
                        lambda comm, steps: dict(profile, steps=steps))
    monkeypatch.setattr(rank_report, "_launched", None)
    blocked = []            # the CPU ranks block op launch (process-wide: not in this process)
    monkeypatch.setattr(gradpool.device, "block_launches", lambda: blocked.append(True))
    launched = []

    def fake_run_ranks(script, args, nproc, log_dir, timeout):
        for name, value in ((rank_report.ENV_DIR, str(log_dir)), ("RANK_ID", "0"),
                            ("MS_ROLE", "MS_WORKER"), ("MS_WORKER_NUM", str(nproc))):
            monkeypatch.setenv(name, value)
        parser = argparse.ArgumentParser()
        runner.add_arguments(parser)
        options = runner.options_from(parser.parse_args(args[1:]))
        launched.append((args, runner._run_as_rank(options)))

    monkeypatch.setattr(launch, "run_ranks", fake_run_ranks)
    options = runner.RunOptions(nproc=2, out=tmp_path / "r.json", quick=True, progress=False,
                                suites=("reduce-dist",))
    assert runner._launch_ranks(options) == {"reduce": rows, "reduce_profile": []}
    assert blocked == [True]
    (args, returned), = launched
    assert returned is None and "--out" not in args        # no side file: the report only
    assert args[args.index("--suites") + 1] == "reduce-dist"
    assert not (tmp_path / "r.json").exists()

    # With the profile: every rank's comes back (the fake ran rank 0 only, so rank 1 has none).
    with_profile = runner.RunOptions(nproc=2, out=tmp_path / "r.json", quick=True,
                                     progress=False, suites=("reduce-dist", "reduce-profile"))
    with pytest.raises(runner.BenchmarkError, match="rank 1 reported no reduce profile"):
        runner._launch_ranks(with_profile)
    assert launched[-1][0][launched[-1][0].index("--suites") + 1] == "reduce-dist,reduce-profile"
    one_rank = runner.RunOptions(nproc=1, out=tmp_path / "r.json", quick=True, progress=False,
                                 suites=("reduce-profile",))
    monkeypatch.setattr(launch, "run_ranks", lambda script, args, nproc, log_dir, timeout:
                        fake_run_ranks(script, args, 2, log_dir, timeout))
    assert runner._launch_ranks(one_rank) == {
        "reduce": [], "reduce_profile": [dict(profile, steps=QUICK.profile_steps)]}

    monkeypatch.setattr(launch, "run_ranks", lambda *args, **kwargs: None)   # rank 0 wrote nothing
    with pytest.raises(runner.BenchmarkError, match="rank 0 reported no reduce rows"):
        runner._launch_ranks(options)


def test_compare_reports_changes_and_fails_above_threshold(quick_results, tmp_path, capsys):
    out, _ = quick_results
    data = json.loads(out.read_text())
    slower = json.loads(out.read_text())
    for row in slower["reduce"]:
        for key in ("median_s", "q1_s", "q3_s"):
            row[key] *= 3                     # every reduce case 200 % slower
    new = tmp_path / "slower.json"
    new.write_text(json.dumps(slower))
    assert benchmarks_main(["compare", str(out), str(out), "--fail-above", "5"]) == 0
    assert benchmarks_main(["compare", str(out), str(new)]) == 0      # no threshold: report only
    printed = capsys.readouterr().out
    assert "+200.0%" in printed and f"reduce {data['reduce'][0]['name']}" in printed
    assert benchmarks_main(["compare", str(out), str(new), "--fail-above", "150"]) == 1
    assert "REGRESSION" in capsys.readouterr().out
    assert benchmarks_main(["compare", str(out), str(tmp_path / "missing.json")]) == 2


def test_compare_never_matches_rows_of_two_launch_modes(quick_results):
    from benchmarks.report import compare
    out, _ = quick_results
    old = json.loads(out.read_text())
    new = json.loads(out.read_text())
    row = new["reduce"][0]
    row["op_launch"] = "blocking"
    for key in ("median_s", "q1_s", "q3_s"):
        row[key] /= 10                        # "10x faster": another mode, not a change
    lines, regressions = compare(old, new, fail_above=5)
    name = f"reduce {row['name']}"
    assert not regressions and not any(line.startswith(name + " ") and "%" in line
                                       for line in lines)
    assert f"{name} (blocking launch)" in "\n".join(lines)
    assert any(line.startswith(name) and line.endswith("only in the old file") for line in lines)
    assert any(line.startswith(f"{name} (blocking launch)") and
               line.endswith("only in the new file") for line in lines)


def test_missing_bench_extra_is_one_line_naming_the_install(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tqdm" else real(name, *a))
    with pytest.raises(runner.BenchmarkError) as err:
        runner.require_bench_extra()
    assert "\n" not in str(err.value) and "pip install -e .[bench]" in str(err.value)
    assert "tqdm" in str(err.value)


def test_every_ratio_compares_two_sides_timed_together(quick_results):
    """Pool, memcpy and zero-copy share one set of rounds; the fresh allocation has a pool series
    of its own (``paired_pool``), and its ratio is computed from that series."""
    out, _ = quick_results
    data = json.loads(out.read_text())
    cases = data["copy"]["cases"]
    by_key = {(c["method"], c["grad_dtype"], c["bucket_dtype"], c["nbytes"], c["count"]): c
              for c in cases}
    for case in cases:
        if case["method"] == "fresh_alloc":
            assert case["interleaved_with"] == ["pool"]
            assert case["paired_pool"]["rounds"] == case["rounds"]
        else:
            assert "paired_pool" not in case
            assert "fresh_alloc" not in case["interleaved_with"]
    for row in data["summary"]["copy_rows"]:
        key = (row["grad_dtype"], row["bucket_dtype"], row["nbytes"], row["count"])
        fresh = by_key[("fresh_alloc", *key)]
        assert row["ratios"]["speed_vs_fresh_alloc"]["median"] == pytest.approx(
            fresh["median_s"] / fresh["paired_pool"]["median_s"])
        assert row["ratios"]["speed_vs_memcpy"]["median"] == pytest.approx(
            by_key[("memcpy", *key)]["median_s"] / by_key[("pool", *key)]["median_s"])
    fixed = data["summary"]["copy_by_pair"]["float32->float32"]
    assert fixed["pack_4KiB_beside_fresh_alloc_us"]["median"] > 0


def test_the_fused_step_profile_times_each_phase_inside_the_step():
    """World 1 in this process (the N-rank profile runs in ``gradpool bench --nproc N``): every
    phase the communicator has is timed, inside the step, per method; the wrapped methods are
    the instances' own again afterwards; the report shows the phases with the signed gap."""
    import mindspore as ms
    from benchmarks.phase_profile import PHASES, profile_fused_step
    from gradpool.comm import SingleProcessCommunicator
    ms.set_device("CPU")
    comm = SingleProcessCommunicator()
    before = dict(vars(comm))
    profile = profile_fused_step(comm, steps=5, warmup=1)
    assert vars(comm) == before
    assert (profile["world_size"], profile["rank"], profile["steps"]) == (1, 0, 5)
    assert set(profile["phases"]) == set(REDUCE_METHODS)
    for method, phases in profile["phases"].items():
        # SingleProcessCommunicator has no _run/_average/_finish: those phases are left out
        assert set(phases) == {"step", "pack", "reduce-scatter"}, method
        for phase, timing in phases.items():
            assert timing["rounds"] == 5 and timing["min_s"] > 0, (method, phase)
            assert timing["mean_s"] < phases["step"]["mean_s"] or phase == "step"
    section = report._profile_section({"reduce_profile": [profile]})
    assert section[0] == "## Where a fused reduce step's time goes, per rank"
    rows = [line for line in section if line.startswith("| 0 |")]
    assert [row.split(" | ")[1] for row in rows] == [p for p in PHASES if p in
                                                     profile["phases"]["pool"]]
    assert all(row.split(" | ")[-1].rstrip(" |")[0] in "+-" for row in rows)
    assert report._profile_section({}) == []    # a file written before the profile existed


def test_a_timed_phase_restores_an_instance_attribute_it_covered():
    from benchmarks.phase_profile import PHASES, _PhaseClock, _timing

    class Thing:
        def work(self):
            return "class"
    thing = Thing()
    thing.work = lambda: "own"
    clock = _PhaseClock()
    with _timing(clock, thing, "work", "pack"), _timing(clock, thing, "absent", "average"):
        clock.step("m", thing.work)
    assert thing.work() == "own" and not hasattr(thing, "absent")
    assert set(clock.samples["m"]) == set(PHASES)
    assert clock.samples["m"]["pack"][0] > 0 and clock.samples["m"]["average"] == [0.0]
    plain = Thing()
    with _timing(clock, plain, "work", "pack"):
        assert "work" in vars(plain)
    assert "work" not in vars(plain) and plain.work() == "class"
