"""Bad input: one clear line on stderr, a non-zero exit, no traceback, nothing half-written."""
import os
import subprocess
import sys

import pytest

from helpers import ROOT, hslm, one_line_error

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
    # a text long enough in bytes that its merges take to a few tokens: the fix is a
    # smaller vocabulary, not more text (the line had said only "too short")
    repetitive = tmp_path / "repetitive.txt"
    repetitive.write_text("a" * 100_000)
    for f, expect in [(empty, "empty"), (short, "too short"), (latin, "not UTF-8"),
                      (tmp_path / "missing.txt", "not found"),
                      (repetitive, "merges took this text to few tokens: a model with a "
                                   "smaller vocabulary")]:
        out_dir = tmp_path / f"o_{f.stem}"
        line = one_line_error(*hslm("train", *TINY, "--data", f, "--out", out_dir))
        assert expect in line
        assert no_checkpoints(out_dir)
        assert ("smaller vocabulary" in line) == (f == repetitive)  # (short's control)


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
    # (the checkpoint's text was the built-in one: the advice is to leave --data out; the
    # advice for a checkpoint trained on a --data text: tests/test_token_cache.py)
    assert line.endswith("differs from the one the checkpoint was trained on; that was the "
                         "built-in text: leave out --data"), line
    # a .state whose .bin is gone or damaged
    d = tmp_path / "copy"
    d.mkdir()
    (d / "ckpt_1.state").write_bytes((good / "ckpt_1.state").read_bytes())
    line = one_line_error(*hslm("train", "--resume", d / "ckpt_1.state", "--steps", "2"))
    assert "ckpt_1.bin" in line
    # already there
    line = one_line_error(*hslm("train", "--resume", good / "ckpt_1.state", "--steps", "1"))
    assert "already at step 1" in line


# ---------------------------------------------- found by a black-box audit of the CLI
@pytest.mark.parametrize("args,name", [
    (["train", *TINY, "--out", ""], "--out"),
    (["train", *TINY, "--metrics", ""], "--metrics"),
    (["train", *TINY, "--resume", ""], "--resume"),
    (["train", *TINY, "--data", ""], "--data"),
    (["train", "--model", "", "--steps", "1"], "--model"),
    (["eval", ""], "CKPT"),
    (["info", ""], "FILE"),
    (["bench", "--model", "", "--steps", "1"], "--model"),
])
def test_an_empty_path_is_refused_not_read_as_here(tmp_path, args, name):
    """Path("") is the current folder: `--out ""` had written a run into it."""
    line = one_line_error(*hslm(*args, cwd=tmp_path))
    assert name in line and "empty" in line, line
    assert os.listdir(tmp_path) == []


def test_a_fifo_or_device_as_metrics_is_refused_up_front(tmp_path):
    fifo = tmp_path / "m.fifo"
    os.mkfifo(fifo)
    for target in (fifo, "/dev/full"):
        out_dir = tmp_path / "o"
        line = one_line_error(*hslm("train", *TINY, "--out", out_dir, "--metrics", target))
        assert "not a regular file" in line, line  # before: hung on the FIFO; /dev/full after step 1
        assert not out_dir.exists()
    # control: a regular file is taken
    code, _, err = hslm("train", *TINY, "--out", tmp_path / "o", "--metrics", tmp_path / "m.jsonl")
    assert code == 0, err
    assert (tmp_path / "m.jsonl").stat().st_size > 0


def test_a_named_state_of_other_parameters_is_refused(tmp_path, good):
    other = tmp_path / "other"
    assert hslm("train", *TINY, "--seed", "2", "--out", other)[0] == 0
    mix = tmp_path / "mix"
    mix.mkdir()
    (mix / "ckpt_1.bin").write_bytes((good / "ckpt_1.bin").read_bytes())
    (mix / "ckpt_1.state").write_bytes((other / "ckpt_1.state").read_bytes())
    for cmd in (["eval", mix / "ckpt_1.state"], ["sample", mix / "ckpt_1.state", "--tokens", "2"]):
        line = one_line_error(*hslm(*cmd))
        assert "belongs to other parameters" in line, line
    # control: naming the .bin evaluates it, the foreign .state set aside with a warning
    code, out, err = hslm("eval", mix / "ckpt_1.bin")
    assert code == 0 and "valid loss" in out and "warning: ignoring" in err
    # and a matching pair named by its .state is used as before
    code, out, err = hslm("eval", good / "ckpt_1.state")
    assert code == 0 and "warning" not in err, err
    # another model's .state: the same words (its header says so before its data is read)
    third = tmp_path / "third"
    small = tmp_path / "small.json"
    small.write_text('{"vocab": 300, "width": 18, "heads": 2, "head_width": 9, "mlp": 54, '
                     '"blocks": 1, "window": 9, "vsa_dim": 128}')
    assert hslm("train", *TINY, "--model", small, "--out", third)[0] == 0
    (mix / "ckpt_1.state").write_bytes((third / "ckpt_1.state").read_bytes())
    assert "belongs to other parameters" in one_line_error(*hslm("eval", mix / "ckpt_1.state"))
    code, out, err = hslm("eval", mix / "ckpt_1.bin")
    assert code == 0 and "valid loss" in out and "warning: ignoring" in err


def test_a_folder_where_a_checkpoint_goes_is_refused_before_the_run(tmp_path, good):
    for name in ("ckpt_1.bin", "ckpt_1.state", "tokenizer.json"):
        out_dir = tmp_path / name.replace(".", "_")
        (out_dir / name).mkdir(parents=True)
        line = one_line_error(*hslm("train", *TINY, "--out", out_dir))
        assert "is a folder" in line and ("tokenizer" if "tok" in name else "step-1") in line, line
        assert sorted(os.listdir(out_dir)) == [name]  # nothing trained, nothing written
    # resuming: the step it saves at
    d = tmp_path / "resume"
    d.mkdir()
    for suffix in (".bin", ".state"):
        (d / f"ckpt_1{suffix}").write_bytes((good / f"ckpt_1{suffix}").read_bytes())
    (d / "ckpt_2.bin").mkdir()
    line = one_line_error(*hslm("train", "--resume", d / "ckpt_1.state", "--steps", "2"))
    assert "ckpt_2.bin is a folder" in line, line
    # control: a folder named for a step the run does not save is left alone
    ok = tmp_path / "ok"
    (ok / "ckpt_5.bin").mkdir(parents=True)
    assert hslm("train", *TINY, "--out", ok)[0] == 0


def test_the_replaced_checkpoints_warning_counts_only_saved_steps(tmp_path):
    d = tmp_path / "d"
    assert hslm("train", *TINY, "--steps", "2", "--out", d)[0] == 0
    code, _, err = hslm("train", *TINY, "--steps", "3", "--out", d)
    assert code == 0 and "already holds" not in err, err  # it saves ckpt_3 only
    code, _, err = hslm("train", *TINY, "--steps", "4", "--save-every", "2", "--out", d)
    assert code == 0 and "(ckpt_2)" in err, err  # control: it does save ckpt_2


def test_other_inputs_the_audit_found(tmp_path, good):
    # sample's seed as train's: at most 2^63 - 1 (it had been taken)
    line = one_line_error(*hslm("sample", good / "ckpt_1.bin", "--tokens", "2",
                                "--seed", str(2 ** 64)))
    assert "--seed" in line
    # bench --threads as train's: at most 1024 (before compiling anything)
    line = one_line_error(*hslm("bench", "--model", "hslm-tiny", "--threads", "100000"))
    assert "--threads" in line and "1024" in line
    # a model config giving a key twice (json keeps the last silently)
    cfg = tmp_path / "dup.json"
    cfg.write_text('{"vocab": 300, "width": 27, "width": 28}')
    line = one_line_error(*hslm("info", cfg))
    assert "'width' is given twice" in line
    # a resumed run's other config names the fields that differ
    line = one_line_error(*hslm("train", "--resume", good / "ckpt_1.state", "--steps", "2",
                                "--model", "hslm-3"))
    assert "width 243 against 27" in line, line
    # a cache folder that is a file: said so
    f = tmp_path / "afile"
    f.write_text("")
    code, _, err = hslm("train", *TINY, "--out", tmp_path / "c", "--cache-dir", f)
    assert code == 0 and f"{f} is not a folder" in err, err
    # a diverged run says no checkpoint of this step is written
    line = one_line_error(*hslm("train", *TINY, "--steps", "3", "--lr", "1e308",
                                "--weight-decay", "0", "--out", tmp_path / "nan"))
    assert "is nan" in line and "checkpoints already written are left" in line, line


def test_a_damaged_checkpoint_says_how(tmp_path, good):
    raw = (good / "ckpt_1.bin").read_bytes()
    flipped = bytearray(raw)
    flipped[-100] ^= 1
    cases = [(raw[:-1000], "truncated: its header describes"), (raw + b"junk", "longer than written"),
             (bytes(flipped), "data checksum mismatch"), (bytes(8) + raw[8:], "no header"),
             (b"\xff" * 8 + raw[8:], "past the file's end")]
    for i, (blob, expect) in enumerate(cases):
        p = tmp_path / f"c{i}.bin"
        p.write_bytes(blob)
        line = one_line_error(*hslm("info", p))
        assert expect in line, line


def test_a_data_folders_subfolders_are_named_not_skipped_silently(tmp_path):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "t.txt").write_text("a text in a subfolder. " * 400)
    line = one_line_error(*hslm("train", *TINY, "--data", d, "--out", tmp_path / "o"))
    assert "has no files" in line and "sub" in line, line
    (d / "a.txt").write_text((ROOT / "README.md").read_text())  # varied enough for BPE
    code, _, err = hslm("train", *TINY, "--data", d, "--out", tmp_path / "o", "-q")
    assert code == 0 and "1 folder(s) in it are not read (sub)" in err, err


def run_without(module, *args):
    """`python -m hslm ARGS` in a fresh process where importing `module` fails as if it
    were not installed: (exit code, stdout, stderr)."""
    code = ("import runpy, sys; sys.modules[%r] = None; sys.argv = ['hslm'] + sys.argv[1:]\n"
            "runpy.run_module('hslm', run_name='__main__', alter_sys=True)" % module)
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("package", ["numpy", "click", "numba"])
def test_a_missing_run_time_package_is_one_line_that_says_how_to_install(tmp_path, package):
    # `python -m hslm` from a checkout that pip never installed: click and numpy are
    # imported with the CLI, numba later, by the command
    out = tmp_path / "o"
    line = one_line_error(*run_without(package, "train", *TINY, "--out", out))
    assert f"Python package {package}," in line and "pip install" in line
    assert no_checkpoints(out)


def test_a_module_of_hslms_own_that_fails_to_import_is_shown_whole(tmp_path):
    # the control for the test above: not a missing dependency but a bug
    code, _, err = run_without("hslm.train", "train", *TINY, "--out", tmp_path / "p")
    assert code != 0 and "Traceback" in err and "hslm.train" in err


def test_numbas_jit_switched_off_is_one_line(good):
    """NUMBA_DISABLE_JIT=1 (Numba's debugging switch) gave a 40-line traceback from every
    command that loads the kernels (the register tiles are LLVM IR, never Python). It is
    one line. Control: info, which loads no kernel, still works."""
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1", "PYTHONPATH": str(ROOT)}
    ck = next(good.glob("ckpt_*.bin"))
    for cmd, code in ((["sample", ck, "--tokens", "2"], 2), (["info", ck], 0)):
        p = subprocess.run([sys.executable, str(ROOT / "cli.py"), *map(str, cmd)],
                           capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == code, p.stderr
        assert (p.stderr == "error: hslm's kernels need Numba's compiler: unset "
                "NUMBA_DISABLE_JIT\n") == (code == 2), p.stderr
