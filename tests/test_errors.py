"""Bad input: one clear line on stderr, a non-zero exit, no traceback, nothing half-written."""
import os

import pytest

from helpers import hslm, one_line_error

TINY = ["--model", "hslm-tiny", "--steps", "1", "--batch", "2"]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    code, out, err = hslm("train", *TINY, "--out", d)
    assert code == 0, err
    return d


def no_checkpoints(d):
    return not d.exists() or not [p for p in os.listdir(d) if p.startswith("ckpt_") or ".tmp" in p]


@pytest.mark.parametrize("args,expect", [
    (["--speed", "7"], "--speed"),
    (["--loss-positions", "0"], "--loss-positions"),
    (["--loss-positions", "10"], "--loss-positions"),
    (["--model", "nope"], "unknown --model"),
    (["--batch", "0"], "--batch"),
])
def test_bad_flags(tmp_path, args, expect):
    out_dir = tmp_path / "o"
    line = one_line_error(*hslm("train", *TINY, "--out", out_dir, *args))
    assert expect in line
    assert no_checkpoints(out_dir)


def test_bad_data(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("too short to hold a window")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 ".encode("latin-1") * 200)
    for f, expect in [(empty, "empty"), (short, "too short"), (latin, "not UTF-8"),
                      (tmp_path / "missing.txt", "not found")]:
        out_dir = tmp_path / f"o_{f.stem}"
        line = one_line_error(*hslm("train", *TINY, "--data", f, "--out", out_dir))
        assert expect in line
        assert no_checkpoints(out_dir)


def test_unwritable_output_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = one_line_error(*hslm("train", *TINY, "--out", blocker / "sub"))
    assert "cannot be written" in line


def test_missing_truncated_and_bitflipped_checkpoints(tmp_path, good):
    line = one_line_error(*hslm("info", tmp_path / "nope.bin"))
    assert "not found" in line
    raw = (good / "ckpt_1.bin").read_bytes()
    cases = {
        "trunc_header.bin": raw[:6],
        "trunc_data.bin": raw[:-100],
        "flip_data.bin": raw[:-50] + bytes([raw[-50] ^ 0x04]) + raw[-49:],
        "flip_header.bin": raw[:20] + bytes([raw[20] ^ 0x40]) + raw[21:],
        "garbage.bin": b"\x00" * 64,
    }
    for name, blob in cases.items():
        p = tmp_path / name
        p.write_bytes(blob)
        for cmd in (["info", p], ["diff", p, good / "ckpt_1.bin"]):
            line = one_line_error(*hslm(*cmd))
            assert "corrupt" in line or "not a valid" in line or "checksum" in line, line


def test_resume_errors(tmp_path, good):
    line = one_line_error(*hslm("train", "--resume", tmp_path / "ckpt_9.state", "--steps", "2"))
    assert "not found" in line
    # config mismatch: flags that decide the bytes must agree with the checkpoint
    for args, expect in [(["--batch", "3"], "--batch"), (["--model", "hslm-3"], "--model"),
                         (["--seed", "5"], "--seed"), (["--loss-positions", "2"], "--loss-positions")]:
        line = one_line_error(*hslm("train", "--resume", good / "ckpt_1.state", "--steps", "2",
                                    *args))
        assert "config mismatch" in line and expect in line
    assert not (good / "ckpt_2.bin").exists()
    # a different text
    other = tmp_path / "other.txt"
    other.write_text("some other text entirely. " * 400)
    line = one_line_error(*hslm("train", "--resume", good / "ckpt_1.state", "--steps", "2",
                                "--data", other))
    assert "differs from the one the checkpoint" in line
    # a .state whose .bin is gone or damaged
    d = tmp_path / "copy"
    d.mkdir()
    (d / "ckpt_1.state").write_bytes((good / "ckpt_1.state").read_bytes())
    line = one_line_error(*hslm("train", "--resume", d / "ckpt_1.state", "--steps", "2"))
    assert "ckpt_1.bin" in line
    # already there
    line = one_line_error(*hslm("train", "--resume", good / "ckpt_1.state", "--steps", "1"))
    assert "already at step 1" in line
