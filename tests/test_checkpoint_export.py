"""What ``export_full`` (and ``gradpool export``) refuses to write over, and the modes of the
files a checkpoint and an export create (issue 37). In one process, a few seconds."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, nn

from gradpool.app.cli import EXIT_USAGE, main
from gradpool.errors import CheckpointError
from hyper_parallel import checkpoint
from hyper_parallel.checkpoint import files


class Net(nn.Cell):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.w = Parameter(ms.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4) * scale),
                           name="w")
        self.b = Parameter(ms.Tensor(np.ones(5, np.float16) * scale), name="b")

    def construct(self, x):
        return x


@pytest.fixture
def saved(tmp_path):
    root = tmp_path / "ck"
    checkpoint.save(root, Net(2.0), step=3)
    return root


def _checkpoint_files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _assert_loads(root: Path) -> None:
    model = Net()
    assert checkpoint.load(root, model)["step"] == 3
    np.testing.assert_array_equal(model.w.asnumpy(), np.arange(12, dtype=np.float32)
                                  .reshape(3, 4) * 2)


def test_a_target_inside_the_checkpoint_is_refused_and_the_checkpoint_survives(saved):
    before = _checkpoint_files(saved)
    rank_file = next(saved.glob("gen-*/rank-00000.safetensors"))
    for target in (rank_file, saved / "model.safetensors",
                   saved / "gen-00000001" / ".." / "x.safetensors"):
        with pytest.raises(CheckpointError, match="lies inside the checkpoint"):
            checkpoint.export_full(saved, target)
    assert _checkpoint_files(saved) == before
    _assert_loads(saved)


def test_a_symlink_a_fifo_or_a_device_is_refused_and_left_as_it_was(saved, tmp_path):
    real = tmp_path / "real.safetensors"
    real.write_bytes(b"keep")
    link = tmp_path / "link.safetensors"
    link.symlink_to(real)
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    for target, kind in ((link, "a symbolic link"), (fifo, "a FIFO")):
        with pytest.raises(CheckpointError, match=f"is {kind}: the export would replace it"):
            checkpoint.export_full(saved, target)
    assert link.is_symlink() and real.read_bytes() == b"keep"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with pytest.raises(CheckpointError, match="does not end in .safetensors"):
        checkpoint.export_full(saved, "/dev/null")
    with pytest.raises(CheckpointError, match="name it model.safetensors"):
        checkpoint.export_full(saved, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_a_damaged_index_geometry_is_a_checkpoint_error_naming_the_tensor(saved, tmp_path,
                                                                          capsys):
    """Pieces that do not cover the tensor, and a shape that is no shape: one line, exit 2."""
    index = json.loads((saved / files.INDEX).read_text())
    index["tensors"]["model/w"]["pieces"][0]["lengths"] = [2, 4]
    (saved / files.INDEX).write_text(json.dumps(index))
    out = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError, match=r"index.json: tensor model/w: .*damaged"):
        checkpoint.export_full(saved, out)
    index["tensors"]["model/w"]["pieces"][0]["lengths"] = [3, 4]
    index["tensors"]["model/w"]["shape"] = ["three", 4]
    (saved / files.INDEX).write_text(json.dumps(index))
    assert main(["export", "--checkpoint", str(saved), "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "index.json: tensor model/w" in err[0], err
    assert not out.exists()


def test_new_files_honour_the_umask(tmp_path):
    """Rank files, the index and the export are 0644 under umask 022 (safetensors alone makes
    0600), 0640 under 027."""
    for umask, mode in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(umask)
        try:
            root = tmp_path / f"ck{umask:o}"
            checkpoint.save(root, Net(), step=1)
            out = tmp_path / f"export{umask:o}.safetensors"
            checkpoint.export_full(root, out)
        finally:
            os.umask(old)
        made = [next(root.glob("gen-*/rank-00000.safetensors")), root / files.INDEX, out]
        assert {str(p): oct(p.stat().st_mode & 0o777) for p in made} == \
            {str(p): oct(mode) for p in made}
