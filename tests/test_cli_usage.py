"""The command line as a new user meets it: --version, -v anywhere, several files to check, and
one line with exit code 2 (never a traceback, nothing left behind) for every bad input."""
import glob
import os
import pathlib
import tempfile

import pytest

from gradpool.app.cli import EXIT_OK, EXIT_USAGE, main

TINY = pathlib.Path(__file__).resolve().parents[1] / "configs" / "deepseek3_tiny.yaml"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("gradpool 0.")


@pytest.mark.parametrize("argv", [["-v", "check-config", str(TINY)],
                                  ["check-config", "-v", str(TINY)],
                                  ["check-config", str(TINY), "--verbose"]])
def test_verbose_before_or_after_the_subcommand(capsys, argv):
    code, out, _ = run(capsys, *argv)
    assert code == EXIT_OK and "fully_shard:" in out


def test_check_config_takes_several_files_and_reports_each(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gradpool:\n  zero_copy: maybe\n")
    code, out, err = run(capsys, "check-config", str(TINY), str(bad), str(TINY))
    assert code == EXIT_USAGE
    assert out.count("fully_shard:") == 2 and out.count(f"# {TINY}") == 2
    assert len(err.strip().splitlines()) == 1 and "gradpool.zero_copy" in err and "bad.yaml" in err


@pytest.mark.parametrize("content, needle", [
    (b"", "is empty; write at least one section"),
    ("model:\n  vocab_size: 67 # gr\xf6\xdfe\n".encode("latin-1"), "is not UTF-8"),
    (b"launch:\n  ranks: 100000\n", "launch.ranks = 100000"),
    (b"gradpool:\n  bucket_cap_mib: 1e-12\n", "gradpool.bucket_cap_mib = 1e-12"),
    (b"gradpool:\n  max_cached_mib: 0.00001\n", "gradpool.max_cached_mib = 1e-05"),
], ids=["empty", "latin-1", "ranks", "tiny cap", "tiny cache"])
def test_bad_config_files_are_one_line_exit_2(capsys, tmp_path, content, needle):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    for argv in (["check-config", str(path)], ["train", "--config", str(path)]):
        code, _, err = run(capsys, *argv)
        assert code == EXIT_USAGE, argv
        assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["bench", "--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["train", "--config", str(TINY), "--timeout", "0"], "--timeout must be > 0, got 0"),
    (["train", "--config", str(TINY), "--timeout", "-5"], "--timeout must be > 0"),
    (["train", "--config", str(TINY), "--reference-rtol", "0"], "--reference-rtol must be > 0"),
])
def test_bad_numbers_are_one_line_exit_2_and_leave_nothing_behind(capsys, argv, needle):
    pattern = os.path.join(tempfile.gettempdir(), "gradpool-*")
    before = set(glob.glob(pattern))
    code, _, err = run(capsys, *argv)
    assert code == EXIT_USAGE
    assert len(err.strip().splitlines()) == 1 and needle in err
    assert set(glob.glob(pattern)) == before, "a refused run left a temporary directory"
