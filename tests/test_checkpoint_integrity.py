"""A corrupted checkpoint is refused, by name, before anything reaches the model (issue 37).

Each case saves a small model and its Adam states, damages the checkpoint on disk the way a
disk, an operator or another writer would, and checks that ``load``, ``export_full`` and the
launcher's pre-launch check (``read_checkpoint``) each raise a :class:`CheckpointError` naming
the file and the tensor, with the target model and optimizer unchanged bit for bit. In one
process, no launch (a few seconds in all).
"""
from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, nn

from gradpool.app.checkpoints import read_checkpoint
from gradpool.errors import CheckpointError
from hyper_parallel import checkpoint
from hyper_parallel.checkpoint import files


class Net(nn.Cell):
    """Two float32 weights of one shape (so their offsets can be swapped), one of another shape,
    and a float16 bias."""

    def __init__(self, seed: int):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.w1 = Parameter(ms.Tensor(rng.standard_normal((4, 6)).astype(np.float32)), name="w1")
        self.w2 = Parameter(ms.Tensor(rng.standard_normal((4, 6)).astype(np.float32)), name="w2")
        self.w3 = Parameter(ms.Tensor(rng.standard_normal((3, 2)).astype(np.float32)), name="w3")
        self.b = Parameter(ms.Tensor(rng.standard_normal(5).astype(np.float16)), name="b")

    def construct(self, x):
        return x


def _model_and_optimizer(seed: int, steps: int = 1):
    model = Net(seed)
    optimizer = nn.Adam(model.trainable_params(), learning_rate=0.1)
    for step in range(steps):      # non-zero moments, so an optimizer left unchanged shows
        grads = tuple(ms.Tensor(np.full(p.shape, 0.5 + step + seed, p.asnumpy().dtype))
                      for p in model.trainable_params())
        optimizer(grads)
    return model, optimizer


def _state(model, optimizer) -> dict:
    return {k: p.asnumpy().copy()
            for k, p in {**model.parameters_dict(), **optimizer.parameters_dict()}.items()}


def _assert_same_bits(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        np.testing.assert_array_equal(got[key].reshape(-1).view(np.uint8),
                                      want[key].reshape(-1).view(np.uint8),
                                      err_msg=key)


@pytest.fixture
def saved(tmp_path):
    model, optimizer = _model_and_optimizer(seed=1)
    root = tmp_path / "ck"
    checkpoint.save(root, model, optimizer, step=1)
    return root, _state(model, optimizer)


def _rank_file(root: Path) -> Path:
    return next(root.glob("gen-*/rank-00000.safetensors"))


def _header(path: Path) -> tuple[dict, int]:
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + length]), length


def _rewrite_header(path: Path, change) -> None:
    """``change`` the header in place, keeping the file's size (padded with spaces, which
    safetensors allows), so only the content is wrong."""
    header, length = _header(path)
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length, "the changed header must fit the old one's room"
    data = bytearray(path.read_bytes())
    data[8:8 + length] = text + b" " * (length - len(text))
    path.write_bytes(bytes(data))


def _data_range(path: Path, key: str) -> tuple[int, int]:
    header, length = _header(path)
    begin, end = header[key]["data_offsets"]
    return 8 + length + begin, 8 + length + end


# -- the damage ---------------------------------------------------------------------------------
def flip_a_byte(root: Path) -> str:
    path = _rank_file(root)
    begin, _ = _data_range(path, "model/w2")
    data = bytearray(path.read_bytes())
    data[begin + 5] ^= 0x10
    path.write_bytes(bytes(data))
    return "model/w2.*checksum"


def write_a_nan(root: Path) -> str:
    path = _rank_file(root)
    begin, _ = _data_range(path, "model/w3")
    data = bytearray(path.read_bytes())
    data[begin + 4:begin + 8] = np.array([np.nan], np.float32).tobytes()
    path.write_bytes(bytes(data))
    return "model/w3.*checksum"


def f32_header_to_i32(root: Path) -> str:
    def change(header):
        header["model/w1"]["dtype"] = "I32"
    _rewrite_header(_rank_file(root), change)
    return r"model/w1 is stored as I32, the index records float32"


def swap_offsets_of_equal_sizes(root: Path) -> str:
    def change(header):
        a, b = header["model/w1"], header["model/w2"]
        a["data_offsets"], b["data_offsets"] = b["data_offsets"], a["data_offsets"]
    _rewrite_header(_rank_file(root), change)
    return "model/w[12].*checksum"


def swap_offsets_of_other_sizes(root: Path) -> str:
    def change(header):
        a, b = header["model/w1"], header["model/w3"]
        a["data_offsets"], b["data_offsets"] = b["data_offsets"], a["data_offsets"]
    _rewrite_header(_rank_file(root), change)
    return r"tensor model/w[13] spans bytes .* take"


def rank_file_of_another_save(root: Path) -> str:
    """The same rank's file of another step: same name, same size, other values."""
    other_model, other_opt = _model_and_optimizer(seed=1, steps=2)
    other = root.parent / "other"
    checkpoint.save(other, other_model, other_opt, step=2)
    shutil.copyfile(_rank_file(other), _rank_file(root))
    assert _rank_file(other).stat().st_size == _rank_file(root).stat().st_size
    return "written by save .* the index by save .*another checkpoint.*it holds tensor"


def _edit_index(root: Path, change) -> None:
    index = json.loads((root / files.INDEX).read_text())
    change(index)
    (root / files.INDEX).write_text(json.dumps(index))


def empty_files_in_index(root: Path) -> str:
    _edit_index(root, lambda index: index.update(files={}))
    return "lists no rank files"


def no_files_in_index(root: Path) -> str:
    _edit_index(root, lambda index: index.pop("files"))
    return "lists no rank files"


def absolute_path_in_index(root: Path) -> str:
    def change(index):
        index["tensors"]["model/w1"]["pieces"][0]["file"] = "/etc/hostname"
    _edit_index(root, change)
    return r"'/etc/hostname' \(tensor model/w1\) lies outside the checkpoint directory"


def dotdot_path_in_index(root: Path) -> str:
    def change(index):
        name = next(iter(index["files"]))
        index["files"] = {f"../{Path(root).name}/{name}": index["files"][name]}
    _edit_index(root, change)
    return "lies outside the checkpoint directory"


DAMAGE = [flip_a_byte, write_a_nan, f32_header_to_i32, swap_offsets_of_equal_sizes,
          swap_offsets_of_other_sizes, rank_file_of_another_save, empty_files_in_index,
          no_files_in_index, absolute_path_in_index, dotdot_path_in_index]
# found only by reading the bytes: the pre-launch check finds them when asked for checksums
BYTES_ONLY = {flip_a_byte, write_a_nan, swap_offsets_of_equal_sizes}


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_a_damaged_checkpoint_is_refused_by_file_and_tensor_with_the_state_unchanged(saved,
                                                                                     damage):
    root, _ = saved
    expected = damage(root)
    in_index = damage.__name__.endswith("_in_index")
    # the file (or the index, when the index itself is bad) is named, and the tensor
    where = str(root / files.INDEX) if in_index else str(_rank_file(root))
    model, optimizer = _model_and_optimizer(seed=7)
    before = _state(model, optimizer)
    with pytest.raises(CheckpointError, match=expected) as refused:
        checkpoint.load(root, model, optimizer)
    assert where in str(refused.value)
    _assert_same_bits(_state(model, optimizer), before)
    out = root.parent / "export.safetensors"
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.export_full(root, out)
    assert not out.exists() and not list(root.parent.glob("export*"))
    # what the launcher checks before a resume launches anything
    with pytest.raises(CheckpointError, match=expected):
        read_checkpoint(root, checksums=True)
    if damage in BYTES_ONLY:
        assert read_checkpoint(root).step == 1      # headers only: the ranks' load finds it
    else:
        with pytest.raises(CheckpointError, match=expected):
            read_checkpoint(root)


def test_an_intact_checkpoint_records_the_checksum_of_every_piece_and_loads_bit_for_bit(saved):
    root, want = saved
    index = json.loads((root / files.INDEX).read_text())
    assert index["checksum"] == "xxh3_64" and len(index["save_id"]) == 16
    header, _ = _header(_rank_file(root))
    assert header["__metadata__"]["gradpool.save_id"] == index["save_id"]
    for name, value in want.items():
        key = f"model/{name}" if f"model/{name}" in index["tensors"] else f"optimizer/{name}"
        (piece,) = index["tensors"][key]["pieces"]
        assert piece["checksum"] == files.checksum(value), key
    model, optimizer = _model_and_optimizer(seed=7)
    assert checkpoint.load(root, model, optimizer)["step"] == 1
    _assert_same_bits(_state(model, optimizer), want)
    assert read_checkpoint(root, checksums=True).step == 1


def test_verify_false_skips_only_the_checksums_and_says_so(saved, caplog):
    """The opt-out for trusted storage: a flipped byte then loads (and is logged as unchecked);
    a header that disagrees with the index is still refused."""
    root, want = saved
    flip_a_byte(root)
    model, optimizer = _model_and_optimizer(seed=7)
    with caplog.at_level(logging.WARNING, logger="hyper_parallel.checkpoint.api"):
        checkpoint.load(root, model, optimizer, verify=False)
    assert "checksums not verified (verify=False" in caplog.text
    got = _state(model, optimizer)
    assert not np.array_equal(got["w2"], want["w2"])      # the damage, loaded as asked
    _assert_same_bits({k: v for k, v in got.items() if k != "w2"},
                      {k: v for k, v in want.items() if k != "w2"})
    f32_header_to_i32(root)
    with pytest.raises(CheckpointError, match="model/w1 is stored as I32"):
        checkpoint.load(root, model, optimizer, verify=False)
    with pytest.raises(Exception, match="verify must be a bool"):
        checkpoint.load(root, model, optimizer, verify="no")


def test_a_version_1_index_needs_an_explicit_opt_out(saved):
    """A checkpoint saved before checksums existed is not passed off as verified."""
    root, want = saved

    def to_version_1(index):
        index["version"] = 1
        for key in ("save_id", "checksum"):
            index.pop(key)
        for record in index["tensors"].values():
            for piece in record["pieces"]:
                piece.pop("checksum")
    _edit_index(root, to_version_1)
    model, optimizer = _model_and_optimizer(seed=7)
    with pytest.raises(CheckpointError, match="before checkpoints carried checksums.*verify=False"):
        checkpoint.load(root, model, optimizer)
    checkpoint.load(root, model, optimizer, verify=False)
    _assert_same_bits(_state(model, optimizer), want)


# -- across ranks: tests/distributed/checkpoint_cases.py, at 2 real msrun ranks
# (w2_one_rank_fails_to_read_every_rank_unchanged) -------------------------------------------


# -- through the command line --------------------------------------------------------------------
def test_the_cli_refuses_a_damaged_checkpoint_in_one_line_before_anything_runs(saved, capsys):
    """``gradpool export`` (checksums: in the export) and ``gradpool train``'s resume (headers,
    sizes and save ids: before the launch) exit 2 with one line naming the file and tensor."""
    from gradpool.app.cli import EXIT_USAGE, main
    root, _ = saved
    flip_a_byte(root)
    out = root.parent / "model.safetensors"
    assert main(["export", "--checkpoint", str(root), "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(_rank_file(root)) in err[0] and "model/w2" in err[0], err
    assert not out.exists()
    f32_header_to_i32(root)
    tiny = Path(__file__).resolve().parents[1] / "configs" / "deepseek3_tiny.yaml"
    assert main(["train", "--config", str(tiny), "--set", f"train.resume_from={root}"]) == \
        EXIT_USAGE
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gradpool train: cannot resume: "), err
    assert str(_rank_file(root)) in err[0] and "model/w1 is stored as I32" in err[0], err
    assert "logs in" not in captured.out        # refused before a log directory, or a launch
