"""Issue 11, through the CLI: what a hostile test saw, each answered with one clear
line and a non-zero exit, or working correctly."""
import json
import math
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from hslm import checkpoint as ckpt
from hslm.errors import HslmError
from hslm.lock import FolderLock
from hslm.train import load_for_inference

from helpers import ROOT, hslm, one_line_error, running

TINY = ["--model", "hslm-tiny", "--batch", "2", "--threads", "1"]
TEXT = "".join(f"sentence {i}: a different corpus about {i % 11} cats and {i % 5} owls.\n"
               for i in range(300))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    code, out, err = hslm("train", *TINY, "--steps", 2, "--save-every", 1, "--seed", 1,
                          "--out", d / "run")
    assert code == 0, err
    return d / "run"


@pytest.mark.parametrize("args,expect", [
    (["--lr", "inf"], "--lr"), (["--lr", "nan"], "--lr"), (["--lr", "0"], "--lr"),
    (["--weight-decay", "nan"], "--weight-decay"), (["--weight-decay", "-1"], "--weight-decay"),
    (["--weight-decay", "1000"], "--weight-decay times --lr must be below 1"),
    (["--weight-decay", "2", "--lr", "0.5"], "got 2.0 x 0.5"),
    (["--seed", "-1"], "--seed"), (["--warmup", "-1"], "--warmup"),
    # the rate had fallen from the peak to 10% in the step after the warm-up
    (["--warmup", "100", "--decay-steps", "100"], "--decay-steps must be past --warmup's 100"),
    (["--warmup", "20000"], "--warmup's 20000 (the cosine decay runs from the warm-up's end "
                            "to it), got 10000"),
    (["--batch", str(10 ** 12)], "memory"),
    (["--metrics", "."], "--metrics"), (["--metrics", "/nonexistent/m.jsonl"], "--metrics"),
    # a folder no one may write, root included (os.access had said yes to root: the run
    # made its output folder and tokenized before it failed to open the file)
    (["--metrics", "/proc/hslm-metrics.jsonl"], "is not writable"),
    (["--data", "/dev/zero"], "not a regular file"),
])
def test_flags_refused_before_anything_is_created(tmp_path, args, expect):
    """(A weight decay with lr x decay >= 1 wipes or flips the weights each step: a
    weight decay of 1e6 had trained to a validation loss of 110, exit 0.)"""
    out_dir = tmp_path / "o"
    line = one_line_error(*hslm("train", *TINY, "--steps", 1, "--out", out_dir, *args,
                                cwd=tmp_path))
    assert expect in line
    assert not out_dir.exists()


def test_a_metrics_link_to_a_missing_folder_is_refused_before_anything(tmp_path):
    """--metrics naming a link to a file in a folder that does not exist had passed the
    checks (taken for a new name, its own folder judged) and failed only after the run
    had made its output folder and tokenized, leaving both behind. Control: a link into
    a folder that exists is appended to through the link."""
    link = tmp_path / "m.jsonl"
    link.symlink_to(tmp_path / "nowhere" / "m.jsonl")
    out = tmp_path / "o"
    line = one_line_error(*hslm("train", *TINY, "--steps", 1, "--out", out, "--metrics", link))
    assert f"{tmp_path / 'nowhere'} does not exist" in line and not out.exists()
    (tmp_path / "nowhere").mkdir()
    code, _, err = hslm("train", *TINY, "--steps", 1, "--out", out, "--metrics", link)
    assert code == 0, err
    assert '"kind": "train"' in (tmp_path / "nowhere" / "m.jsonl").read_text()


@pytest.mark.parametrize("case", ["the output folder", "a folder above it",
                                  "the token cache folder", "a folder above that"])
def test_metrics_naming_a_folder_the_run_makes_is_refused_before_anything(tmp_path, case):
    """--metrics naming the output or token cache folder, or a folder above one, before the
    run makes it: the checks had judged it a new file's name, and the run failed to open
    it ("Is a directory") only after making and filling those folders, left behind. Now:
    one line, nothing created. Control: a file inside the output folder is appended to."""
    out, cache = tmp_path / "a" / "out", tmp_path / "c" / "cache"
    metrics, expect = {
        "the output folder": (out, "is the run's output folder"),
        "a folder above it": (tmp_path / "a", f"is a folder above the run's output folder {out}"),
        "the token cache folder": (cache, "is the run's token cache folder"),
        "a folder above that": (tmp_path / "c",
                                f"is a folder above the run's token cache folder {cache}"),
    }[case]
    args = ("train", *TINY, "--steps", 1, "--out", out, "--cache-dir", cache, "--metrics")
    line = one_line_error(*hslm(*args, metrics))
    assert f"error: --metrics {metrics} {expect}; give the metrics file another name" == line
    assert os.listdir(tmp_path) == []
    code, _, err = hslm(*args, out / "m.jsonl")
    assert code == 0, err
    assert '"kind": "train"' in (out / "m.jsonl").read_text()


@pytest.mark.parametrize("case", ["tokenizer.json", "checkpoint", "lock", "data file",
                                  "data folder", "token cache", "a link to tokenizer.json",
                                  "a hard link to a file of the data folder"])
def test_metrics_naming_one_of_the_runs_own_files_is_refused_before_anything(tmp_path, case,
                                                                              monkeypatch):
    """--metrics may not name a file the run writes (cut short or replaced by it, the
    metrics or the file were lost), nor its text (appended to, the text changed and the
    run's checkpoints could not be resumed): one line, nothing created, the text as it
    was. The control: the same run with a metrics file of another name is accepted."""
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text(TEXT)
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("HSLM_CACHE_DIR", str(cache))  # (inherited by the CLI's process)
    out = tmp_path / "o"
    metrics, expect, control = {
        "tokenizer.json": (out / "tokenizer.json", "a name this run writes in its output",
                           out / "metrics.jsonl"),
        "checkpoint": (out / "ckpt_1.state", "a name this run writes in its output",
                       out / "ckpt_1.jsonl"),
        "lock": (out / ".hslm.lock", "a name this run writes in its output", out / "lock"),
        "data file": (text / "a.txt", "is in the training text", tmp_path / "a.txt"),
        "data folder": (text / "m.jsonl", "is in the training text", tmp_path / "m.jsonl"),
        "token cache": (cache / "text-sha256.json", "a name this run writes in its token cache",
                        cache / "metrics.jsonl"),
        # (judged by where the link leads: the run had cut its tokenizer.json short)
        "a link to tokenizer.json": (tmp_path / "ml", "a name this run writes in its output",
                                     tmp_path / "mc"),
        # (the file itself, under another name: it had been appended to)
        "a hard link to a file of the data folder": (tmp_path / "hl", "is in the training text",
                                                     tmp_path / "hc"),
    }[case]
    if case.startswith("a hard link"):
        os.link(text / "a.txt", metrics)
    if case.startswith("a link"):
        os.symlink(out / "tokenizer.json", metrics)
        os.symlink(out / "metrics.jsonl", control)
    data = text / "a.txt" if case == "data file" else text
    args = ("train", *TINY, "--steps", 1, "--data", data, "--out", out, "--metrics")
    line = one_line_error(*hslm(*args, metrics))
    assert expect in line, line
    assert not out.exists() and os.listdir(text) == ["a.txt"] and os.listdir(cache) == []
    assert (text / "a.txt").read_text() == TEXT
    code, _, err = hslm(*args, control)
    assert code == 0, err
    assert '"kind": "train"' in control.read_text() and (text / "a.txt").read_text() == TEXT


def test_a_refused_cache_folder_leaves_nothing_in_the_text_folder(tmp_path):
    """The token cache folder that is the --data folder is refused before the output
    folder's lock is taken (which had stayed behind in the user's text folder)."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text(TEXT)
    line = one_line_error(*hslm("train", *TINY, "--steps", 1, "--data", d, "--out", tmp_path / "o",
                                "--cache-dir", d))
    assert "token cache folder" in line and "is the --data folder" in line
    assert os.listdir(d) == ["a.txt"] and not (tmp_path / "o").exists()


@pytest.mark.parametrize("resume", [False, True])
def test_an_output_folder_that_is_the_text_folder_is_refused(tmp_path, resume):
    """--out naming a --data folder is refused before anything is written, whatever the
    token cache folder: with another --cache-dir the run had written its checkpoints and
    tokenizer.json among its text, so that a resume of it said "the training text differs",
    eval read ckpt_N.bin as text, and a fresh run trained on the tokenizer's JSON too."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text(TEXT)
    cache = tmp_path / "cache"
    first = ["--data", d, "--cache-dir", cache]
    if resume:  # a run of that text elsewhere, resumed with its output in the text folder
        code, _, err = hslm("train", *TINY, "--steps", 1, *first, "--out", tmp_path / "run")
        assert code == 0, err
        args = ["--resume", tmp_path / "run" / "ckpt_1.state", "--steps", 2]
    else:
        args = [*TINY, "--steps", 1]
    for cache_args in ([], ["--cache-dir", cache]):
        line = one_line_error(*hslm("train", *args, "--data", d, "--out", d, *cache_args))
        assert line.startswith(f"error: the output folder {d} is the --data folder"), line
        assert os.listdir(d) == ["a.txt"]
    code, _, err = hslm("train", *args, *first, "--out", tmp_path / "o")  # the control
    assert code == 0, err
    assert os.listdir(d) == ["a.txt"]


def test_the_state_says_the_built_in_text_by_its_bytes_not_its_name(tmp_path):
    """The .state's data_source says whether the run's text is the built-in one by the
    text's sha256, never by how it was given. A --data file named as the built-in text is
    labelled ("built-in python-...") had been recorded as the built-in text (and the same
    file by its absolute path as --data text); a run resumed with a copy of the built-in
    text given as --data, or the other way round, wrote a .state that differed from the
    uninterrupted run's in data_source alone."""
    import gzip
    from hslm.data import BUILTIN_FILE, BUILTIN_SOURCE
    (tmp_path / BUILTIN_SOURCE).write_text(TEXT)
    copy = tmp_path / "copy.txt"
    copy.write_bytes(gzip.decompress(BUILTIN_FILE.read_bytes()))

    def train(name, *args):
        code, _, err = hslm("train", *TINY, "--out", tmp_path / name, *args, cwd=tmp_path)
        assert code == 0, err
        st = ckpt.read(tmp_path / name / "ckpt_1.state", expect_kind="state", keep_data=False)
        return st.meta["data_source"]
    assert train("named", "--steps", 1, "--data", BUILTIN_SOURCE) == "--data text"
    assert train("by-path", "--steps", 1, "--data", tmp_path / BUILTIN_SOURCE) == "--data text"
    assert train("whole", "--steps", 2, "--save-every", 1) == BUILTIN_SOURCE
    assert train("copy", "--steps", 1, "--data", copy) == BUILTIN_SOURCE
    code, _, err = hslm("train", "--resume", tmp_path / "copy" / "ckpt_1.state", "--steps", 2,
                        cwd=tmp_path)  # resumed on the built-in text itself
    assert code == 0, err
    for ext in (".bin", ".state"):
        name = "ckpt_2" + ext
        assert (tmp_path / "copy" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()


def test_an_error_naming_a_file_with_a_newline_is_one_line(tmp_path):
    """A file name holding a newline (or another control character) split the error into
    two lines: the message's control characters are written as escapes. Control: the same
    file under a plain name gives the same line, unescaped."""
    for name in ("x\ny\x1b.txt", "xy.txt"):
        d = tmp_path / name.replace("\n", "n").replace("\x1b", "e")
        d.mkdir()
        (d / name).write_bytes(b"\xff\xfe")
        line = one_line_error(*hslm("train", *TINY, "--steps", 1, "--data", d,
                                    "--out", tmp_path / "o"))
        shown = name.replace("\n", "\\n").replace("\x1b", "\\x1b")
        assert line == f"error: data file {d / shown} is not UTF-8 text (byte 0xff at offset 0)"


def test_a_renamed_checkpoint_resumes_from_its_own_step_and_says_so(base, tmp_path):
    """A .state renamed to another step's name had resumed from the step it holds without
    a word. Control: under its own name, no warning."""
    for name in ("ckpt_7", "ckpt_2"):
        d = tmp_path / name
        d.mkdir()
        for ext in (".bin", ".state"):
            shutil.copy(base / f"ckpt_2{ext}", d / f"{name}{ext}")
        code, out, err = hslm("train", "--resume", d / f"{name}.state", "--steps", 3, "-q")
        assert code == 0 and (d / "ckpt_3.bin").exists(), err
        warned = (f"warning: {d / name}.state holds step 2, not 7 (a file renamed?); going on "
                  "from step 2")
        assert err.strip() == (warned if name == "ckpt_7" else ""), err


def test_utf16_text_without_a_byte_order_mark_is_refused_not_trained_on(tmp_path):
    """UTF-16 text without a byte order mark is valid UTF-8 (every other byte NUL for
    Latin text) and had been trained on without a word; a file an eighth or more NUL
    bytes is refused, in one line, nothing made. Controls: a text with a few NULs trains;
    with the mark, UTF-16 was already refused as not UTF-8."""
    u16 = tmp_path / "u16.txt"
    u16.write_bytes(TEXT.encode("utf-16-le"))
    assert one_line_error(*hslm("train", *TINY, "--steps", 1, "--data", u16, "--out",
                                tmp_path / "o")) == (
        f"error: data file {u16} is 50.0% NUL bytes (the first at offset 1): UTF-16 text or "
        "binary data, not UTF-8 text")
    assert not (tmp_path / "o").exists()
    few = tmp_path / "few.txt"
    few.write_bytes(TEXT.encode().replace(b"\n", b"\x00\n", 40))
    code, out, err = hslm("train", *TINY, "--steps", 1, "--data", few, "--out", tmp_path / "o")
    assert code == 0, err
    u16.write_bytes(TEXT.encode("utf-16"))  # (with its mark)
    assert "is not UTF-8 text (byte 0xff at offset 0)" in one_line_error(
        *hslm("train", *TINY, "--steps", 1, "--data", u16, "--out", tmp_path / "p"))


def test_a_cache_folder_of_a_name_too_long_is_a_warning(tmp_path):
    """A --cache-dir whose name is too long for the file system had stopped the run (its
    tidying asked whether the folder exists, and that raised): like any cache folder that
    cannot be written, it is a warning, and the run trains. Control: a name of a
    folder that can be made is used, without a warning."""
    for cache, warned in ((tmp_path / ("c" * 300), True), (tmp_path / "c", False)):
        code, _, err = hslm("train", *TINY, "--steps", 1, "--out", tmp_path / f"o{warned}",
                            "--cache-dir", cache)
        assert code == 0 and (tmp_path / f"o{warned}" / "ckpt_1.bin").exists(), err
        assert ("going on without the token cache" in err) == warned, err


def test_an_output_folder_behind_a_link_to_nothing_says_so(tmp_path):
    """--out naming a link to nothing (or a folder under one) had been refused as
    "cannot be written: File exists" (the folder cannot be made at the link's name); the
    line now says it is a link to nothing and where it points. Control: once what it
    names exists, the run writes there through the link."""
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "elsewhere")
    for out in (link, link / "sub"):
        line = one_line_error(*hslm("train", *TINY, "--steps", 1, "--out", out))
        assert f"{link} is a link to nothing ({tmp_path / 'elsewhere'})" in line, line
    (tmp_path / "elsewhere").mkdir()
    code, _, err = hslm("train", *TINY, "--steps", 1, "--out", link)
    assert code == 0 and (tmp_path / "elsewhere" / "ckpt_1.bin").exists(), err


def test_a_run_that_fails_on_its_text_leaves_no_cache_folder(tmp_path):
    """A text that fails its checks (not UTF-8) had its sha256 remembered first, so the
    run left behind the --cache-dir folder it made (holding that memo) while it removed
    its output folder. A text is remembered once it has been read and checked. Control:
    a good text's run remembers it there."""
    from hslm.token_cache import TEXT_SHA_MEMO
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe" + TEXT.encode())
    (tmp_path / "good.txt").write_text(TEXT)
    time.sleep(2.1)  # (a file written within 2 s of its hashing is never remembered)
    cache, out = tmp_path / "c", tmp_path / "o"
    line = one_line_error(*hslm("train", *TINY, "--steps", 1, "--data", tmp_path / "bad.txt",
                                "--out", out, "--cache-dir", cache))
    assert "not UTF-8" in line and not out.exists() and not cache.exists()
    code, _, err = hslm("train", *TINY, "--steps", 1, "--data", tmp_path / "good.txt",
                        "--out", out, "--cache-dir", cache)
    assert code == 0 and (cache / TEXT_SHA_MEMO).exists(), err


def test_steps_past_64_bits_is_one_line(tmp_path):
    line = one_line_error(*hslm("train", *TINY, "--steps", 2 ** 63, "--out", tmp_path / "o"))
    assert "--steps must be from 1 to 2^63 - 1" in line and not (tmp_path / "o").exists()


def test_resume_of_a_missing_path_creates_nothing(tmp_path):
    line = one_line_error(*hslm("train", "--resume", tmp_path / "no" / "dir" / "ckpt_5.state",
                                "--steps", 9))
    assert "not found" in line and not (tmp_path / "no").exists()


def test_a_diverging_run_stops_before_writing_non_finite_numbers(tmp_path):
    d = tmp_path / "nan"
    # (step 1's parameters are about 1e200, finite and saved; step 2's loss is not finite.
    # An lr of 1e30 with the default weight decay, lr x decay far above 1, did it before)
    line = one_line_error(*hslm("train", *TINY, "--steps", 6, "--save-every", 1, "--lr",
                                "1e200", "--weight-decay", 0, "--warmup", 0, "--out", d))
    assert (d / "ckpt_1.bin").exists()
    assert "step " in line and ("not finite" in line or "nan" in line)
    step = int(line.split("step ")[1].split(":")[0])
    for n in range(1, step):  # every checkpoint written is finite and loads
        for ext in (".bin", ".state"):
            ckpt.read(d / f"ckpt_{n}{ext}").check_finite()
    assert not (d / f"ckpt_{step}.bin").exists()


def test_sample_and_eval_flags(base):
    b = base / "ckpt_2.bin"
    for args, expect in [(["--temperature", "nan"], "--temperature"),
                         (["--temperature", "1e-320"], "--temperature"),
                         (["--temperature", "-1"], "--temperature"),
                         (["--seed", "-1"], "--seed")]:
        assert expect in one_line_error(*hslm("sample", b, *args))
    assert "--loss-positions" in one_line_error(*hslm("eval", b, "-k", 0))
    assert "--loss-positions" in one_line_error(*hslm("eval", b, "-k", 10))


def test_non_finite_checkpoint_is_refused_by_eval_and_sample(base, tmp_path):
    ck = ckpt.read(base / "ckpt_2.bin")
    theta = ck.flat().copy()
    theta[-1] = np.inf
    d = tmp_path / "bad"
    d.mkdir()
    (d / "ckpt_2.bin").write_bytes(b"".join(ckpt.params_parts(ck.config, theta, 2, ck.tokenizer())))
    for cmd in ("eval", "sample"):
        line = one_line_error(*hslm(cmd, d / "ckpt_2.bin"))
        assert "non-finite" in line and "bout" in line


def test_the_runs_tokenizer_travels_with_its_model(base, tmp_path):
    code, ref, err = hslm("eval", base / "ckpt_2.bin", "--threads", 1)
    assert code == 0, err
    # another run's tokenizer.json beside the checkpoint is ignored, with a warning
    d = tmp_path / "copy"
    d.mkdir()
    for ext in (".bin", ".state"):
        (d / f"ckpt_2{ext}").write_bytes((base / f"ckpt_2{ext}").read_bytes())
    other = tmp_path / "other.txt"
    other.write_text(TEXT)
    from hslm.data import Tokenizer
    (d / "tokenizer.json").write_text(Tokenizer.train(TEXT, 300).to_json())
    code, out, err = hslm("eval", d / "ckpt_2.bin", "--threads", 1)
    assert code == 0 and out == ref and "ignoring" in err and "tokenizer.json" in err
    # no tokenizer.json at all: the same number
    (d / "tokenizer.json").unlink()
    code, out, err = hslm("eval", d / "ckpt_2.bin", "--threads", 1)
    assert code == 0 and out == ref and not err
    # another text is encoded with the run's tokenizer
    _, _, tok, _ = load_for_inference(d / "ckpt_2.bin")
    assert tok.identity == ckpt.read(base / "ckpt_2.state").meta["tokenizer"]
    code, out, err = hslm("eval", d / "ckpt_2.bin", "--data", other, "--threads", 1)
    assert code == 0 and out != ref, err


def test_one_writer_per_folder(tmp_path):
    d = tmp_path / "locked"
    d.mkdir()
    held = FolderLock(d).acquire()
    try:
        with pytest.raises(HslmError, match=f"process {os.getpid()}"):
            FolderLock(d).acquire()
        (tmp_path / "t.txt").write_text(TEXT)
        line = one_line_error(*hslm("train", *TINY, "--steps", 1, "--out", d,
                                    "--data", tmp_path / "t.txt"))
        assert f"process {os.getpid()}" in line and "another hslm run" in line
        # refused before the text is read: no checkpoint, and no cache written either
        assert os.listdir(d) == [".hslm.lock"], os.listdir(d)
    finally:
        held.release()
    # a lock left by a killed process does not block
    p = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]);"
                          "from hslm.lock import FolderLock; FolderLock(sys.argv[2]).acquire();"
                          "print('held', flush=True); time.sleep(60)", str(ROOT), str(d)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    with pytest.raises(HslmError, match=f"process {p.pid}"):
        FolderLock(d).acquire()
    p.kill()
    p.wait()
    FolderLock(d).acquire().release()


@pytest.mark.parametrize("how", ["replaced", "unlocked"])
def test_a_folder_replaced_or_unlocked_during_the_run_is_not_written_to(tmp_path, how):
    """The run's folder moved away and a new one made under its name: a second run could
    lock the new folder while the first went on saving there (two writers in one
    folder). Now the first run saves through the folder it locked, and stops with one
    line. With its lock file removed (another run may lock the folder itself) it saves
    nothing more and stops."""
    d = tmp_path / "X"
    # (200 steps: long enough to be running at the change, short enough that a run which
    # does not stop ends soon; it once wrote 69 GB of checkpoints, killed by nothing)
    p = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "train", *map(str, TINY),
                          "--steps", "200", "--save-every", "1", "--log-every", "1",
                          "--out", str(d)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    with running(p, timeout=300):
        for line in p.stdout:  # until step 3 has been reported (and step 2 saved)
            if line.startswith("step ") and int(line.split()[1]) >= 3:
                break
        if how == "replaced":
            os.rename(d, tmp_path / "X.old")
            d.mkdir()
        else:
            os.unlink(d / ".hslm.lock")
        _, err = p.communicate(timeout=120)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert p.returncode == 2 and "Traceback" not in err and len(errors) == 1, err
    held = tmp_path / ("X.old" if how == "replaced" else "X")
    saved = sorted(int(n[5:-4]) for n in os.listdir(held) if n.endswith(".bin"))
    assert saved == list(range(1, saved[-1] + 1)) and saved[-1] >= 2, saved
    for n in saved:  # every one whole, each .bin with its .state
        ckpt.read(held / f"ckpt_{n}.state")
    if how == "replaced":
        assert errors[0].startswith(f"error: {d} is no longer the folder this run locked"), err
        assert f"step {saved[-1]} is saved in the folder it locked" in errors[0]
        assert os.listdir(d) == []  # nothing written into the new folder
    else:
        assert errors[0].startswith(f"error: the lock file {d / '.hslm.lock'} was removed"), err
        assert f"step {saved[-1] + 1} not saved" in errors[0]


def _check_with_the_lock_removed_at(call, lock, monkeypatch):
    """lock.check(), the lock file removed just before its call number `call` to
    os.stat / os.fstat (the race CI once met: removed between the two reads)."""
    import hslm.lock as lock_module
    real = {"stat": os.stat, "fstat": os.fstat}
    calls = []

    def removing_before(name):
        def f(*a, **kw):
            calls.append(name)
            if len(calls) == call and os.path.exists(lock.path):
                os.unlink(lock.path)
            return real[name](*a, **kw)
        return f
    # (check() calls nothing else of os)
    monkeypatch.setattr(lock_module, "os", types.SimpleNamespace(
        stat=removing_before("stat"), fstat=removing_before("fstat")))
    try:
        return lock.check(), len(calls)
    finally:
        monkeypatch.setattr(lock_module, "os", os)


def test_a_lock_file_removed_while_it_is_checked_is_never_taken_for_a_moved_folder(
        tmp_path, monkeypatch):
    """Removed at any point of the check, the answer is "unlocked" or, removed after the
    name was read, nothing yet (and "unlocked" at the next check): never "moved", which
    would save one more step into a folder another run may hold. Control: the order
    of reads before the fix (the file held, then its name) answers "moved"."""
    seen = set()
    for call in (1, 2):  # before the first read, between the two
        d = tmp_path / f"run{call}"
        d.mkdir()
        lock = FolderLock(d).acquire()
        try:
            answer, n_calls = _check_with_the_lock_removed_at(call, lock, monkeypatch)
            assert answer in (None, "unlocked"), (call, answer)
            assert lock.check() == "unlocked"
            seen.add(answer)
        finally:
            lock.release()
    assert n_calls == 2 and seen == {None, "unlocked"}

    import hslm.lock as lock_module

    def old_check(self):  # the file held first, then its name (through the module's os)
        held = lock_module.os.fstat(self.fd)
        if held.st_nlink == 0:
            return "unlocked"
        try:
            st = lock_module.os.stat(self.path)
        except OSError:
            return "moved"
        return None if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino) else "moved"
    d = tmp_path / "control"
    d.mkdir()
    lock = FolderLock(d).acquire()
    try:
        monkeypatch.setattr(FolderLock, "check", old_check)
        assert _check_with_the_lock_removed_at(2, lock, monkeypatch)[0] == "moved"
    finally:
        lock.release()


def test_a_folder_that_may_be_written_but_not_listed_is_opened_as_a_path(tmp_path,
                                                                         monkeypatch):
    """Mode 0733 (write and search, no read): opening the folder read-only fails, where
    naming files in it by path worked; it is then opened as a path only (O_PATH), which
    serves to create, rename and remove files in it."""
    from hslm.checkpoint import open_folder, write_atomic
    if not hasattr(os, "O_PATH"):
        pytest.skip("no O_PATH here")
    real_open = os.open

    def no_read(path, flags, *a, **kw):  # as for a user without read permission
        if os.path.isdir(path) and not flags & os.O_PATH:
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", no_read)
    fd = open_folder(tmp_path)
    try:
        write_atomic(tmp_path / "a.bin", b"abc", dir_fd=fd)
        held = FolderLock(tmp_path).acquire()
        held.release()
    finally:
        os.close(fd)
    write_atomic(tmp_path / "b.bin", b"def")
    assert (tmp_path / "a.bin").read_bytes() == b"abc"
    assert (tmp_path / "b.bin").read_bytes() == b"def"


@pytest.mark.parametrize("steps", [3, 1])
def test_metrics_write_failure_saves_and_stops(tmp_path, steps):
    """A metrics file whose writes fail mid-run (a file-size limit standing in for a full
    disk: the file is filled to 100 bytes short of it, so the first record fails; a
    FIFO or device as --metrics is refused up front, tests/test_errors.py). In the last
    step (steps 1) no resume command: it would be refused, the run being at --steps."""
    import resource
    limit = 1 << 20  # above the checkpoints of hslm-tiny; Python ignores SIGXFSZ
    m = tmp_path / "m.jsonl"
    m.write_bytes(b"\n" * (limit - 100))
    d = tmp_path / "mf"
    p = subprocess.run([sys.executable, str(ROOT / "cli.py"), "train", *map(str, TINY), "--steps",
                        str(steps), "--metrics", str(m), "--out", str(d)], capture_output=True,
                       text=True,
                       timeout=600,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    line = one_line_error(p.returncode, p.stdout, p.stderr)
    assert "cannot write --metrics" in line and "saved" in line
    assert ("resume with" in line) == (steps > 1), line
    ckpt.read(d / "ckpt_1.state")
    # the record that did not fit left nothing (it left its first 100 bytes, and the
    # printed resume command then appended to that half line: hslm plot refused the file)
    assert m.read_bytes() == b"\n" * (limit - 100)


def test_a_metrics_file_ending_in_a_partial_line_is_cut_back_to_its_last_whole_line(tmp_path,
                                                                                   capsys):
    """A run killed while writing a record leaves part of a line; the next run appending
    to the file cuts it off (with a warning) so that every line stays a record."""
    from hslm.plot import read_metrics
    from hslm.progress import Metrics
    m = tmp_path / "m.jsonl"
    whole = json.dumps({"kind": "train", "step": 1, "loss": 5.0}) + "\n"
    m.write_text(whole + '{"kind": "train", "st')
    metrics = Metrics(m)
    assert "partial record" in capsys.readouterr().err
    metrics.write(kind="train", step=2, loss=4.0)
    metrics.close()
    assert read_metrics(m)[0] == [(1, 5.0), (2, 4.0)]
    m.write_text('{"kind": "tr')  # no whole line at all
    Metrics(m).close()
    assert m.read_bytes() == b"" and "its 12 bytes removed" in capsys.readouterr().err
    m.write_text(whole)  # whole lines: left as they are, no warning
    Metrics(m).close()
    assert m.read_text() == whole and capsys.readouterr().err == ""
    # a file that is not a metrics file cut short is refused, not cut (before the run too)
    # a record whole but for its newline is cut too
    m.write_text(whole + whole.strip())
    Metrics(m).close()
    assert m.read_text() == whole and "partial record" in capsys.readouterr().err
    # (a whole JSON object that is no record of hslm's, a config written by json.dump,
    # had been cut away as a partial record: refused now)
    for other in ("notes\nmy important notes", whole + "free text", "x" * 70000,
                  "[1, 2]\n{partial", '{"a": 1}', whole + '{"a": 1}',
                  '{"a":' * 12000):  # (nested too deep for json: had been a traceback)
        m.write_text(other)
        with pytest.raises(HslmError, match="is not a metrics file cut short"):
            Metrics(m)
        assert m.read_text() == other
    line = one_line_error(*hslm("train", *TINY, "--steps", 1, "--metrics", m,
                                "--out", tmp_path / "o"))
    assert "is not a metrics file cut short" in line and not (tmp_path / "o").exists()
    # a torn record after a blank line is cut as after a record (a record after a blank
    # line, a user's note's, had been no record: the file and the resume command refused)
    m.write_text(whole + "\n" + '{"kind": "train", "st')
    Metrics(m).close()
    assert m.read_text() == whole + "\n" and "partial record" in capsys.readouterr().err
    # a last line longer than the tail read back is no record (had passed unread)
    m.write_text("notes\n" + "x" * 70000 + "\n")
    with pytest.raises(HslmError, match="its last line is over 64 KB"):
        Metrics(m)


def test_plot_refuses_what_it_cannot_do(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"kind": "train", "step": 1, "loss": 5.0}) + "\n")
    for name in ("myplot", "out.xyz"):
        line = one_line_error(*hslm("plot", m, "-o", tmp_path / name))
        assert "-o" in line and ".png" in line
        assert not (tmp_path / name).exists() and not (tmp_path / f"{name}.png").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe{}\n")
    assert "UTF-8" in one_line_error(*hslm("plot", bad, "-o", tmp_path / "x.png"))


def test_plot_of_extreme_values_and_of_a_file_cut_short(tmp_path):
    """A step past 2^63 - 1 (no run writes one) and losses of +-1e308 had been
    tracebacks (OverflowError; matplotlib's ValueError, and an UnboundLocalError in its
    ticker for steps 0 and 1.7e308): one line each, no image. A metrics file ending in a
    partial record, as a run killed while writing it leaves one, had been refused; it is
    drawn without that record, with a warning. Controls: the largest step is drawn, and
    the same file whole draws with no warning."""
    def rec(step, loss):
        return '{"kind": "train", "step": %s, "loss": %s}\n' % (step, loss)
    cases = {"step": rec(1, 1.0) + rec(2 ** 63, 2.0), "losses": rec(1, 1e308) + rec(2, -1e308),
             "largest": rec(0, 1.0) + rec(2 ** 63 - 1, 2.0)}
    for name, text in cases.items():
        (tmp_path / f"{name}.jsonl").write_text(text)
        args = ("plot", tmp_path / f"{name}.jsonl", "-o", tmp_path / f"{name}.png")
        if name == "largest":
            code, _, err = hslm(*args)
            assert code == 0 and err == "" and (tmp_path / "largest.png").exists(), err
            continue
        line = one_line_error(*hslm(*args))
        assert ("from 0 to 2^63 - 1" if name == "step" else "cannot draw") in line, line
        assert not (tmp_path / f"{name}.png").exists()
    whole = rec(1, 5.0) + rec(2, 4.5)
    for name, text in (("cut", whole + '{"grad_norm": 0.3, "kind": "tr'), ("whole", whole)):
        (tmp_path / f"{name}.jsonl").write_text(text)
        code, out, err = hslm("plot", tmp_path / f"{name}.jsonl", "-o", tmp_path / f"{name}.png")
        assert code == 0 and (tmp_path / f"{name}.png").exists(), err
        assert ("partial record" in err and len(err.splitlines()) == 1) == (name == "cut"), err


def test_info_describes_a_checkpoint_whatever_its_name(base, tmp_path):
    """`hslm info ck.json` of a checkpoint had been read as a model config and refused
    with train's words ("--model ck.json is an hslm checkpoint ... --resume"). Control: a
    JSON config of that name is still described as a config."""
    ck = tmp_path / "ck.json"
    ck.write_bytes((base / "ckpt_2.bin").read_bytes())
    code, out, err = hslm("info", ck)
    assert code == 0 and out.startswith(f"file      {ck}") and "step      2" in out, err
    cut = tmp_path / "cut.json"  # cut inside its header: a damaged checkpoint, not a config
    cut.write_bytes((base / "ckpt_2.bin").read_bytes()[:1000])
    assert "is damaged (its header length" in one_line_error(*hslm("info", cut))
    # a model config is one whatever its name, as --model takes it (one not named *.json
    # had been refused as "not an hslm checkpoint")
    for name in ("ck.json", "config", "config.JSON"):
        (tmp_path / name).write_text('{"vocab": 300, "width": 12, "heads": 2, "head_width": 6, '
                                     '"mlp": 24, "blocks": 1, "window": 9, "vsa_dim": 64}')
        code, out, err = hslm("info", tmp_path / name)
        assert code == 0 and out.splitlines()[0].startswith("model"), err


def test_info_and_model_refuse_a_files_name_ending_as_a_folders(base, tmp_path):
    """`hslm info ck.bin/` (or `ck.bin/.`) described ck.bin, and `train --model c.json/`
    read c.json (Path drops the slash and the "."), where eval and sample refuse such a
    name. Controls: the names without it; a folder's name with it is still called a
    folder."""
    ck = f"{base / 'ckpt_2.bin'}"
    for name in (ck + "/", ck + "/."):
        assert one_line_error(*hslm("info", name)) == (
            f"error: {name} ends as a folder's name does (a slash, . or ..), but {ck} is a "
            "file; give the file's name")
    code, out, err = hslm("info", ck)
    assert code == 0 and "step      2" in out, err
    assert "is a directory" in one_line_error(*hslm("info", f"{base}/"))
    config = tmp_path / "c.json"
    config.write_text('{"vocab": 300, "width": 12, "heads": 2, "head_width": 6, "mlp": 24, '
                      '"blocks": 1, "window": 9, "vsa_dim": 64}')
    for cmd in (["info"], ["train", "--steps", "1", "--out", tmp_path / "o", "--model"]):
        assert f"but {config} is a file" in one_line_error(*hslm(*cmd, f"{config}/"))
        code, out, err = hslm(*cmd, config)
        assert code == 0, err
    # --data too (a file or a folder: it had trained on the file)
    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    line = one_line_error(*hslm("train", *TINY, "--steps", 1, "--data", f"{text}/.", "--out",
                                tmp_path / "p"))
    assert "--data" in line and f"{text}/. ends as a folder's name does" in line, line
    assert not (tmp_path / "p").exists()


def test_info_describes_a_runs_tokenizer_and_token_cache(tmp_path):
    """`hslm info` of the tokenizer.json a run writes, of its token cache's bpe-*.json and
    tokens-*.tok: the first two had been refused as model configs ("missing width, ..."),
    the last as "not an hslm checkpoint". They are described, with the identity `info`
    of a .bin names; a damaged cache says so (exit 0: a run tokenizes its text again), a
    tokenizer that is not one is one line (exit 2). Control: a model config as before."""
    data = tmp_path / "t.txt"
    data.write_text(TEXT)
    d = tmp_path / "run"
    assert hslm("train", *TINY, "--steps", 1, "--data", data, "--out", d)[0] == 0
    code, out, err = hslm("info", d / "ckpt_1.bin")
    identity = next(x for x in out.splitlines() if x.startswith("tokenizer ")).split()[1]
    [cached] = d.glob("bpe-*.json")
    [tokens] = d.glob("tokens-*.tok")
    for f, kind in ((d / "tokenizer.json", "kind      tokenizer (byte-level BPE"),
                    (cached, "cached with the text it was learned from"),
                    (tokens, "kind      token cache (HSLMTOK2)")):
        code, out, err = hslm("info", f)
        assert code == 0 and kind in out and f"tokenizer {identity}" in out, (f, out, err)
    assert "checksum  ok" in out and "data      text sha256 " in out
    raw = bytearray(tokens.read_bytes())
    raw[-1] ^= 1
    tokens.write_bytes(bytes(raw))
    code, out, err = hslm("info", tokens)
    assert code == 0 and "checksum  MISMATCH: damaged" in out, out
    tokens.write_bytes(bytes(raw[:-2]))
    assert "its header does not describe it" in one_line_error(*hslm("info", tokens))
    forged = tmp_path / "forged.json"
    forged.write_text('{"format":"hslm-bpe","version":1,"vocab":300,"merges":[[1,999]]}')
    assert "merge 0 is [1, 999]" in one_line_error(*hslm("info", forged))
    # saved again by another tool, its keys in another order (merges first, past the
    # first bytes read): still a tokenizer, not a model config missing its fields
    obj = json.loads((d / "tokenizer.json").read_text())
    resaved = tmp_path / "resaved.json"
    resaved.write_text(json.dumps({"merges": obj["merges"], "vocab": obj["vocab"],
                                   "version": 1, "format": "hslm-bpe"}, indent=2))
    code, out, err = hslm("info", resaved)
    assert code == 0 and f"tokenizer {identity}" in out, (out, err)
    other = tmp_path / "bpe-other.json"
    other.write_text(json.dumps(dict(json.loads(cached.read_text()), version="hslm-bpe-cache/9")))
    assert "a token cache's tokenizer of another hslm's rules (hslm-bpe-cache/9" in \
        one_line_error(*hslm("info", other))
    code, out, err = hslm("info", "hslm-tiny")
    assert code == 0 and out.splitlines()[0].startswith("model"), err


def test_damaged_and_foreign_files_through_the_cli(base, tmp_path):
    raw = (base / "ckpt_2.state").read_bytes()
    i = raw.index(b'\\"lr\\":0.001') + len(b'\\"lr\\":0.00')
    flipped = raw[:i] + bytes([raw[i] ^ 0x02]) + raw[i + 1:]  # lr 0.001 -> 0.003
    d = tmp_path / "flip"
    d.mkdir()
    (d / "ckpt_2.state").write_bytes(flipped)
    (d / "ckpt_2.bin").write_bytes((base / "ckpt_2.bin").read_bytes())
    for cmd in (["info", d / "ckpt_2.state"], ["train", "--resume", d / "ckpt_2.state",
                                               "--steps", 3]):
        assert "damaged" in one_line_error(*hslm(*cmd))
    deep = tmp_path / "deep.bin"
    h = b"[" * 100000 + b"]" * 100000
    deep.write_bytes(len(h).to_bytes(8, "little") + h)
    assert "damaged" in one_line_error(*hslm("info", deep))
    bad_tok = tmp_path / "tok"
    bad_tok.mkdir()
    (bad_tok / "tokenizer.json").write_text('{"format":"hslm-bpe","version":1,"vocab":300,'
                                            '"merges":[[4,99999]]}')
    (bad_tok / "ckpt_2.bin").write_bytes((base / "ckpt_2.bin").read_bytes())
    code, out, err = hslm("sample", bad_tok / "ckpt_2.bin", "--tokens", 3)
    assert code == 0 and "ignoring" in err and "Traceback" not in err


def test_a_huge_tokenizer_json_beside_a_checkpoint_is_not_read_whole(base, tmp_path,
                                                                     monkeypatch):
    """The tokenizer.json beside a checkpoint is read only to warn when it is not the
    checkpoint's own: one larger than twice that tokenizer's JSON cannot be, and is
    ignored unread (a 300 MB one had been read whole, then parsed)."""
    import hslm.train as train
    parsed = []
    real = train.Tokenizer.from_json
    monkeypatch.setattr(train.Tokenizer, "from_json",
                        staticmethod(lambda raw: parsed.append(len(raw)) or real(raw)))
    d = tmp_path / "huge"
    d.mkdir()
    (d / "ckpt_2.bin").write_bytes((base / "ckpt_2.bin").read_bytes())
    with open(d / "tokenizer.json", "wb") as f:
        f.truncate(300 << 20)  # sparse
    warned = []
    load_for_inference(d / "ckpt_2.bin", warn=warned.append)
    assert max(parsed) < 1 << 20 and len(warned) == 1 and "ignoring" in warned[0]
    (d / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())  # control
    warned.clear()
    n = len(parsed)
    load_for_inference(d / "ckpt_2.bin", warn=warned.append)
    assert len(parsed) > n and warned == []  # read, parsed, and the checkpoint's own


@pytest.mark.parametrize("started", ["cli.py", "-m hslm", "script"])
def test_resume_command_printed_on_ctrl_c_runs_verbatim(tmp_path, started):
    """The command says hslm as the run was started (it had said `hslm` always, which a
    checkout's `python cli.py` or `python -m hslm` need not have on its PATH, nor a
    console script started by its path), with this interpreter (a venv's, whose python
    links to another's), and runs as it is given."""
    data = tmp_path / "my text.txt"
    data.write_text(TEXT * 3)
    d = tmp_path / "out"
    script = os.path.join(os.path.dirname(sys.executable), "hslm")
    if started == "script" and not os.path.exists(script):
        pytest.skip("no console script beside this interpreter")
    how = {"cli.py": [sys.executable, str(ROOT / "cli.py")], "-m hslm": [sys.executable, "-m",
                                                                            "hslm"],
           "script": [script]}[started]
    proc = subprocess.Popen([*how, "train", *TINY, "--steps",
                             "100000", "--data", str(data), "--out", str(d), "--log-every", "1",
                             "--save-every", "50000", "--eval-every", "40000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with running(proc, timeout=300):
        for line in proc.stdout:
            if line.startswith("step ") and int(line.split()[1]) >= 2:
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    cmd = [line for line in out.splitlines()
           if line.startswith("resume with: ")][0][len("resume with: "):]
    argv = shlex.split(cmd)
    if started == "script":
        assert argv[0] in ("hslm", script) and argv[1] == "train", cmd
        assert os.path.samefile(shutil.which(argv[0]), script), cmd
    else:
        prefix = subprocess.run([argv[0], "-c", "import sys; print(sys.prefix)"],
                                capture_output=True, text=True).stdout.strip()
        assert prefix == sys.prefix and argv[1:len(how) + 1] == [*how[1:], "train"], cmd
    assert "--data" in argv, cmd
    for flag, value in (("--save-every", "50000"), ("--eval-every", "40000"),
                        ("--log-every", "1"), ("--threads", "1")):  # the run's cadence, kept
        assert argv[argv.index(flag) + 1] == value, cmd
    step = int(argv[argv.index("--steps") - 1].split("ckpt_")[1].split(".")[0])
    argv[argv.index("--steps") + 1] = str(step + 1)  # one more step is enough to prove it runs
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "saved " in p.stdout, p.stderr


def test_devices_and_fifos_are_refused_without_reading(base, tmp_path):
    """/dev/zero would fill memory and a FIFO would wait for a writer: one line each."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for cmd in (["info", "/dev/zero"], ["eval", "/dev/zero"], ["info", fifo],
                ["diff", fifo, base / "ckpt_2.bin"], ["plot", "/dev/zero"],
                ["train", "--resume", "/dev/zero", "--steps", 3],
                ["train", "--model", "/dev/zero", "--steps", 1, "--out", tmp_path / "o"],
                ["bench-compare", fifo, fifo]):
        assert "not a regular file" in one_line_error(*hslm(*cmd)), cmd
    assert not (tmp_path / "o").exists()
    line = one_line_error(*hslm("sample", base / "ckpt_2.bin", "--prompt", "\udcff"))
    assert "--prompt" in line and "UTF-8" in line


def test_a_run_that_fails_on_its_text_leaves_no_new_folder(base, tmp_path):
    """Nor a --cache-dir it made: a text too short had been refused after its tokens were
    cached, in a cache folder made for them (train and eval). Control: a text that fits
    makes the cache folder."""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"cats and owls \xff\xfe")
    short = tmp_path / "short.txt"
    short.write_text("hello world")
    cache = tmp_path / "cache" / "x"
    for data, expect in ((bad, "UTF-8"), (short, "too short")):
        out = tmp_path / "new" / "run"
        assert expect in one_line_error(*hslm("train", *TINY, "--steps", 1, "--data", data,
                                              "--out", out, "--cache-dir", cache))
        assert not (tmp_path / "new").exists()  # the folders it made are gone again
        assert not (tmp_path / "cache").exists()
        assert expect in one_line_error(*hslm("eval", base / "ckpt_2.bin", "--data", data,
                                              "--cache-dir", cache))
        assert not (tmp_path / "cache").exists()
    code, out, err = hslm("eval", base / "ckpt_2.bin", "--cache-dir", cache)
    assert code == 0 and any(cache.glob("tokens-*.tok")), err
    out = tmp_path / "resumed"
    line = one_line_error(*hslm("train", "--resume", base / "ckpt_2.state", "--steps", 2,
                                "--out", out))
    assert "already at step 2" in line and not out.exists()


def test_a_closed_standard_output_does_not_stop_the_run(tmp_path):
    """`hslm train | head -1`: the run goes on without its output and saves."""
    # (400 steps, a line each: still writing when its reader has gone, however late)
    out = tmp_path / "piped"
    p = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "train", *TINY, "--steps", "400",
                          "--log-every", "1", "--out", str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    with running(p, timeout=600):
        p.stdout.readline()
        p.stdout.close()  # the reader goes away
        err = p.stderr.read().decode()
        assert p.wait(timeout=600) == 0, err
    assert "Traceback" not in err and "going on without it" in err
    ckpt.read(out / "ckpt_400.state")
    # `2>&1 | head -1`: both streams into the closed pipe, the note on stderr included
    out = tmp_path / "both"
    p = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "train", *TINY, "--steps", "400",
                          "--log-every", "1", "--out", str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    with running(p, timeout=600):
        p.stdout.readline()
        p.stdout.close()
        assert p.wait(timeout=600) == 0
    ckpt.read(out / "ckpt_400.state")


def test_bench_paths_and_reports_are_judged_first(tmp_path):
    for path in (tmp_path / "no" / "b.json", tmp_path):
        line = one_line_error(*hslm("bench", "--model", "hslm-tiny", "--json", path))
        assert "--json" in line
    good = {"steps": 1, "models": [{"model": "m", "rows": [{"tok_s": "fast"}]}]}
    for name, report in (("a.json", good), ("b.json", good)):
        (tmp_path / name).write_text(json.dumps(report))
    line = one_line_error(*hslm("bench-compare", tmp_path / "a.json", tmp_path / "b.json"))
    assert "not an hslm bench report" in line
    # no run in it (an empty list of models, or of rows): compared as if it were one, exit 0
    for models in ([], [{"model": "m", "rows": []}]):
        (tmp_path / "e.json").write_text(json.dumps({"steps": 1, "models": models}))
        line = one_line_error(*hslm("bench-compare", tmp_path / "e.json", tmp_path / "e.json"))
        assert "e.json: not an hslm bench report (no run in it)" in line, line
    # a real report with a tok/s of 0: a ratio divides by it (it was a ZeroDivisionError)
    zero = json.loads((ROOT / "docs" / "bench" / "threads.json").read_text())
    zero["models"][0]["rows"][0]["tok_s"] = 0.0
    (tmp_path / "zero.json").write_text(json.dumps(zero))
    line = one_line_error(*hslm("bench-compare", tmp_path / "zero.json",
                                ROOT / "docs" / "bench" / "threads.json"))
    assert "zero.json: not an hslm bench report" in line, line


def test_bench_json_may_not_name_its_own_inputs_nor_end_in_a_slash(tmp_path):
    """--json had replaced the bench's own model config or text with its report (or put
    it in a --data folder, to be read as text next time), and `--json a.json/` replaced
    a.json (Path drops the slash). Each refused before anything runs, its file intact.
    A model that cannot be benched is refused before the models before it are timed.
    Control: the same bench with another --json writes it, first (a standard output that
    fails had lost it)."""
    cfg = tmp_path / "m.json"
    from hslm.config import PRESETS
    cfg.write_text(PRESETS["hslm-tiny"].to_json())
    text = tmp_path / "t.txt"
    text.write_text("the text of the bench. " * 2000)
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("more text. " * 2000)
    keep = {p: p.read_bytes() for p in (cfg, text)}
    args = ["--speed", "3", "--steps", "1", "--no-torch", "--no-profile"]
    for extra, json_path, expect in (
            (["--model", cfg], cfg, f"--json {cfg} is the model config {cfg}"),
            (["--model", "hslm-tiny", "--data", text], text, f"is the --data file {text}"),
            (["--model", "hslm-tiny", "--data", folder], folder / "r.json",
             f"report's folder {folder} is the --data folder {folder}"),
            (["--model", "hslm-tiny"], f"{tmp_path / 'r'}/", "ends as a folder's name does"),
            (["--model", "hslm-tiny"], f"{cfg}/.", "ends as a folder's name does")):
        code, out, err = hslm("bench", *extra, *args, "--json", json_path)
        assert code == 2 and expect in one_line_error(code, out, err), err
        assert "set up" not in err  # (nothing ran)
    # a link in the --data folder: write_atomic replaces the link there (it does not write
    # through it), so it is refused as a name there is, wherever it leads
    (tmp_path / "elsewhere.json").write_text("{}")
    (folder / "link.json").symlink_to(tmp_path / "elsewhere.json")
    code, out, err = hslm("bench", "--model", "hslm-tiny", "--data", folder, *args, "--json",
                          folder / "link.json")
    assert code == 2 and f"report's folder {folder} is the --data folder" in err, err
    assert {p: p.read_bytes() for p in keep} == keep and not (folder / "r.json").exists()
    code, out, err = hslm("bench", "--model", "hslm-tiny,hslm-test", *args)
    assert code == 2 and "--model hslm-test: vocabulary 27 is too small" in err
    assert "set up" not in err, err
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, str(ROOT / "cli.py"), "bench", "--model", cfg,
                            *args, "--json", str(tmp_path / "r.json")], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=600)
    assert p.returncode == 2 and json.loads((tmp_path / "r.json").read_text())["models"]


@pytest.mark.parametrize("args,expect", [(["-k", "0"], "--loss-positions"),
                                         (["-k", "10"], "--loss-positions"),
                                         (["--batch", "0"], "--batch"),
                                         (["--data", "missing.txt"], "data file not found")])
def test_bench_flags_are_judged_before_it_compiles(monkeypatch, capsys, args, expect):
    """-k, --data and the batch had been judged only after the machine's first compile
    (minutes) and the peak's measurement: judged before either, as --model and --json
    are. Control: good flags reach the compile."""
    import hslm.precompile as precompile
    from hslm.cli import main

    def compiling(*a, **k):
        raise RuntimeError("compiling")
    monkeypatch.setattr(precompile, "compile_first", compiling)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--model", "hslm-tiny", "--speed", "3", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and expect in err and err.count("\n") == 1, err
    with pytest.raises(RuntimeError, match="compiling"):
        main(["bench", "--model", "hslm-tiny", "--speed", "3", "-k", "9"])


def test_figures_past_a_million_are_said_in_five_digits():
    """A crafted model's perplexity of exp(299) had been said in 130 digits on eval's and
    train's lines (a loss of 1e300 was already short)."""
    from hslm.train import perplexity, short_figure
    assert short_figure(perplexity(299.0), 1) == "7.1458e+129"
    assert [short_figure(x, 2) for x in (74.6249, 999999.994, -1e300, math.inf, math.nan)] == [
        "74.62", "999999.99", "-1.0000e+300", "inf", "nan"]


def test_perplexity_past_the_largest_double_is_inf_not_an_overflow_error():
    import math
    from hslm.train import perplexity
    assert perplexity(1.0) == math.e and perplexity(709.0) == math.exp(709.0)
    assert perplexity(710.0) == math.inf  # math.exp(710.0) raises OverflowError


def test_a_run_says_when_it_replaces_checkpoints_already_there(base, tmp_path):
    d = tmp_path / "shared"
    assert hslm("train", *TINY, "--steps", 2, "--out", d)[0] == 0
    code, out, err = hslm("train", *TINY, "--steps", 2, "--seed", 5, "--out", d)
    assert code == 0 and "already holds checkpoints at steps this run saves (ckpt_2)" in err
    code, out, err = hslm("train", "--resume", d / "ckpt_2.state", "--steps", 3)
    assert code == 0 and "already holds" not in err  # ckpt_3 is new


def test_sample_prints_as_it_draws_the_text_decoding_all_at_once_gives(base):
    """The CLI writes each token as it is drawn (a character split across tokens waits
    for its last byte): the same text as the ids decoded at once, replacement marks
    included."""
    from hslm.sample import sample as sample_ids
    from hslm.speeds import DEFAULT_SPEED
    from hslm.step import Worker
    cfg, state, tok, _ = load_for_inference(base / "ckpt_2.bin")
    for seed in (0, 3):
        ids = sample_ids(Worker(cfg, DEFAULT_SPEED), state.kernel_model(), state.tables.vsa,
                         tok.encode("é"), 200, 0.8, 40, seed, cfg.window)
        code, out, err = hslm("sample", base / "ckpt_2.bin", "--tokens", 200, "--seed", seed,
                              "--prompt", "é")
        assert code == 0, err
        assert out == "é" + tok.decode(ids) + "\n"


def test_sample_writes_the_drawn_text_unchanged_as_utf8_whatever_the_stream(base, tmp_path):
    """Into a pipe, a terminal's colour codes stay (click.echo had dropped them when stdout
    was not a terminal, so a file did not hold the tokens drawn), and the text is UTF-8
    whatever the locale's encoding: with PYTHONIOENCODING=latin-1 a prompt in another
    script had been a UnicodeEncodeError traceback, as had train's and info's lines
    naming a folder such as t\u20ac (now written as escapes)."""
    from hslm.sample import sample as sample_ids
    from hslm.speeds import DEFAULT_SPEED
    from hslm.step import Worker
    cfg, state, tok, _ = load_for_inference(base / "ckpt_2.bin")
    cli = [sys.executable, str(ROOT / "cli.py")]
    for prompt, env in (("a\x1b[31mb", {}), ("h\u00e9llo \u20ac", {"PYTHONIOENCODING": "latin-1"})):
        ids = sample_ids(Worker(cfg, DEFAULT_SPEED), state.kernel_model(), state.tables.vsa,
                         tok.encode(prompt), 20, 0.8, 40, 4, cfg.window)
        p = subprocess.run(cli + ["sample", str(base / "ckpt_2.bin"), "--tokens", "20", "--seed",
                                  "4", "--prompt", prompt], capture_output=True, timeout=600,
                           env={**os.environ, **env})
        assert p.returncode == 0, p.stderr
        assert p.stdout == (prompt + tok.decode(ids) + "\n").encode("utf-8")
    env = {**os.environ, "PYTHONIOENCODING": "latin-1"}
    p = subprocess.run(cli + ["train", *TINY, "--steps", "1", "--out", str(tmp_path / "t\u20ac")],
                       capture_output=True, timeout=600, env=env)
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr
    assert b"t\\u20ac" in p.stdout + p.stderr  # control: the name was written, escaped
    p = subprocess.run(cli + ["info", str(tmp_path / "t\u20ac" / "ckpt_1.bin")],
                       capture_output=True, timeout=600, env=env)
    assert p.returncode == 0 and b"t\\u20ac" in p.stdout, p.stderr


def test_a_path_of_bytes_that_are_not_utf8_is_written_as_those_bytes(tmp_path):
    """A --data name holding a byte that is not UTF-8 (Python keeps it as a lone
    surrogate) had been a UnicodeEncodeError traceback from the run's header line on a
    strict UTF-8 stdout, after the output folder was made; now the name's own bytes go out."""
    from hslm.data import builtin_text
    name = os.fsdecode(b"caf\xe9.txt")
    (tmp_path / name).write_text(builtin_text()[:30000])
    p = subprocess.run([sys.executable, str(ROOT / "cli.py"), "train", *TINY, "--steps", "1",
                        "--data", str(tmp_path / name), "--out", str(tmp_path / "o")],
                       capture_output=True, timeout=600,
                       env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"})
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr
    assert b"caf\xe9.txt" in p.stdout


def test_sample_stops_when_its_reader_goes(base):
    """`hslm sample ... | head -c 1`: sample's text is all it makes, so it stops drawing at
    the next token (exit 0, no note), where it had drawn every token into /dev/null."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "sample",
                             str(base / "ckpt_2.bin"), "--tokens", "1000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with running(proc, timeout=600):
        assert len(proc.stdout.read(1)) == 1  # it writes ...
        proc.stdout.close()  # ... and its reader goes
        code = proc.wait(timeout=120)  # a million tokens take hours
        err = proc.stderr.read().decode()
    assert code == 0 and err == "", err


def test_sample_and_eval_with_their_standard_output_closed_say_so(base):
    """`hslm sample ... >&-` had been an AttributeError traceback and `hslm eval ... >&-`
    a quiet exit 0: their output is all they make, so both refuse in one line."""
    for cmd in (["sample", str(base / "ckpt_2.bin"), "--tokens", "2"],
                ["eval", str(base / "ckpt_2.bin")]):
        p = subprocess.run([sys.executable, str(ROOT / "cli.py"), *cmd], stderr=subprocess.PIPE,
                           text=True, timeout=600, preexec_fn=lambda: os.close(1))
        line = one_line_error(p.returncode, "", p.stderr)
        assert "standard output is closed" in line, line


def test_streams_closed_at_the_start_go_to_dev_null(base, tmp_path):
    """`hslm train ... >&-` had stopped with a traceback at its first progress line (Python
    leaves a closed stream None), before its first save; it trains and saves, as with a
    reader gone. `hslm eval --json ... 2>&-` had printed its warning into the standard
    output, ahead of the JSON (print to a None stderr writes to stdout); the warning now
    goes nowhere and the output is the JSON alone. Controls: with the streams open, the
    progress and the warning are where they belong."""
    def cli(*args, close):
        return subprocess.run([sys.executable, str(ROOT / "cli.py"), *map(str, args)],
                              capture_output=True, text=True, timeout=600,
                              preexec_fn=(lambda: os.close(close)) if close else None)
    for close in (1, None):
        out = tmp_path / f"run{close}"
        p = cli("train", *TINY, "--steps", 2, "--out", out, close=close)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        assert (out / "ckpt_2.bin").exists() and (out / "ckpt_2.state").exists()
        assert ("valid " in p.stdout) == (close is None)
    ck = tmp_path / "alone" / "ckpt_2.bin"
    ck.parent.mkdir()
    ck.write_bytes((base / "ckpt_2.bin").read_bytes())
    (ck.parent / "tokenizer.json").write_text("{}")  # not its tokenizer: a warning
    for close in (2, None):
        p = cli("eval", ck, "--json", close=close)
        assert p.returncode == 0
        assert json.loads(p.stdout)["checkpoint"] == str(ck), p.stdout
        assert ("warning: ignoring" in p.stderr) == (close is None)


def test_a_command_whose_output_is_its_product_says_nothing_when_its_reader_goes(base):
    """`hslm info CKPT | head -1` had added "the standard output was closed; going on
    without it" (train's note: it goes on and saves). info's output is all it makes, so
    it ends as quietly as its reader did; train's note stays (test above)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "info",
                             str(base / "ckpt_2.bin")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, bufsize=0)
    with running(proc, timeout=600):
        proc.stdout.read(1)
        proc.stdout.close()
        code = proc.wait(timeout=120)
        err = proc.stderr.read().decode()
    assert code == 0 and err == "", err


def test_sample_from_a_model_whose_logits_overflow_prints_nothing_but_its_line(base,
                                                                               tmp_path):
    """A finite checkpoint whose head is 1e307 times its trained one (every check passed)
    has logits that are not finite: sample fails on its first token with one line, and
    had printed the prompt before it. Control: the checkpoint as trained prints the
    prompt and its tokens."""
    ck = ckpt.read(base / "ckpt_2.bin")
    tensors = [(n, ck.tensor(n) * (1e307 if n == "Wout" else 1)) for n in ck.names()]
    huge = tmp_path / "ckpt_2.bin"
    huge.write_bytes(ckpt.encode(tensors, dict(ck.meta)))
    code, out, err = hslm("sample", huge, "--tokens", 4, "--prompt", "ab", "--seed", 1)
    assert "logits are not finite" in one_line_error(code, out, err) and out == "", out
    code, out, err = hslm("sample", base / "ckpt_2.bin", "--tokens", 4, "--prompt", "ab")
    assert code == 0 and out.startswith("ab") and len(out) > len("ab\n"), (out, err)


def test_logits_near_the_largest_double_are_sampled_not_padded(base, tmp_path):
    """A finite checkpoint whose head's bias is 1.7e308 (every check passed): its logits
    divided by the temperature overflowed, every weight was NaN, and sample drew PAD (id
    0) each time, printing the prompt alone after numpy's warnings; eval --json gave a
    null loss beside a perplexity of 0.0. Now such logits are scaled from their maximum
    (only then, so a seed's text is as before); eval's loss is null, and its plain
    cross-entropy that of equal logits, ln V. Control: the checkpoint as trained samples
    its seed's text as before."""
    ck = ckpt.read(base / "ckpt_2.bin")
    cfg = ck.config
    theta = ck.flat().copy()
    t = [n for n, _, _ in cfg.tensors()].index("bout")
    theta[cfg.offsets()[t]:cfg.offsets()[t + 1]] = 1.7e308
    huge = tmp_path / "ckpt_2.bin"
    ckpt.write_atomic(huge, ckpt.params_parts(cfg, theta, ck.step, ck.tokenizer()))
    code, out, err = hslm("sample", huge, "--tokens", 8, "--prompt", "ab", "--seed", 1)
    assert code == 0 and err == "" and len(out) > len("ab\n") and "\x00" not in out, (out, err)
    code, out, err = hslm("eval", huge, "--json")
    r = json.loads(out)
    assert code == 0 and r["valid_loss"] is None, out
    # every logit 1.7e308: a uniform distribution, whose plain cross-entropy is ln V (the
    # smoothed loss's mean of z overflowed; its bits are training's and stay)
    assert r["cross_entropy"] == pytest.approx(math.log(cfg.vocab), rel=1e-14), out
    assert r["perplexity"] == pytest.approx(cfg.vocab, rel=1e-12), out
    runs = [hslm("sample", base / "ckpt_2.bin", "--tokens", 8, "--prompt", "ab", "--seed", 1)
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][0] == 0


def test_sample_never_draws_an_id_without_a_piece(base):
    """Ids from the tokenizer's last piece up (a text too short for the vocabulary's
    merges) stand for nothing: sample never draws them."""
    from hslm.sample import sample as sample_ids
    from hslm.speeds import DEFAULT_SPEED
    from hslm.step import Worker
    cfg, state, tok, _ = load_for_inference(base / "ckpt_2.bin")
    bound = tok.n_ids - 40  # as if the last 40 merges had not been learned

    def draw(**kw):
        return sample_ids(Worker(cfg, DEFAULT_SPEED), state.kernel_model(), state.tables.vsa,
                          tok.encode("the "), 300, 3.0, 0, 1, cfg.window, **kw)

    assert max(draw(drawable=bound)) < bound
    assert max(draw()) >= bound  # control: drawn where nothing forbids them


@pytest.mark.parametrize("signum", [None, signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_the_kernels_compile_trains_nothing(tmp_path, monkeypatch, capsys,
                                                         signum):
    """A signal while the step's kernels compiled (before step 1; under MPI a first run
    compiles them there, for half a minute) had been taken as a stop after the current
    step: the run went on, after the compile, to train step 1 and save it. It is now as
    one while the text was read: one line, 130 or 143, nothing trained, the folder the
    run made removed. Control (None): no signal, the run trains and saves. (While cached
    kernels load, a second, a stop still finishes step 1 and saves: the test below.)"""
    import hslm.step as step
    from hslm.cli import main
    real = step.warm_up

    def warm_up_then_signal(runner, run):
        real(runner, run)
        if signum is not None:  # as if it had come while they compiled
            os.kill(os.getpid(), signum)
    monkeypatch.setattr(step, "warm_up", warm_up_then_signal)
    monkeypatch.setattr(step, "kernels_cached", lambda *a, **k: False)  # (they compile)
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY, "--steps", "2", "--out", str(out)])
    err = capsys.readouterr().err
    if signum is None:
        assert e.value.code == 0 and (out / "ckpt_2.bin").exists(), err
        return
    assert e.value.code == 128 + signum, err
    name = "interrupted" if signum == signal.SIGINT else "terminated"
    assert err.splitlines()[-1] == f"error: {name}", err
    assert "stopping once the step's kernels are compiled, with nothing trained" in err
    assert "Traceback" not in err and not out.exists()


def metrics_records(path):
    """A metrics file's records as (kind, step, loss): what two runs' files compare by."""
    return [(r["kind"], r["step"], r.get("loss", r.get("valid_loss")))
            for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.parametrize("command", [True, False])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_the_text_is_read_removes_the_folder_and_says_one_line(
        tmp_path, monkeypatch, capsys, signum, command):
    """SIGTERM or SIGHUP (a closed terminal) while the run reads its text: one line, 128 +
    the signal, nothing trained and the folder the run made removed. SIGHUP had ended the
    run at once, leaving that folder and its lock, as a kill does. The hslm command then
    ignores SIGHUP (a closed terminal sends two: the second had ended its tidying up); a
    program calling hslm gets its own handler back (command False)."""
    import hslm
    import hslm.train as train
    from hslm.cli import main
    monkeypatch.setattr(hslm, "_the_hslm_command", lambda: command)
    monkeypatch.setattr(train, "_the_hslm_command", lambda: command)
    real = train.load_corpus

    def load_then_signal(*a, **k):
        os.kill(os.getpid(), signum)
        return real(*a, **k)
    monkeypatch.setattr(train, "load_corpus", load_then_signal)
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY, "--steps", "2", "--out", str(out)])
    err = capsys.readouterr().err
    word = "terminated" if signum == signal.SIGTERM else "hung up"
    assert e.value.code == 128 + signum and err.splitlines()[-1] == f"error: {word}", err
    assert "Traceback" not in err and not out.exists()
    assert signal.getsignal(signum) == (
        signal.SIG_IGN if signum == signal.SIGHUP and command else signal.SIG_DFL)
    signal.signal(signum, signal.SIG_DFL)


def test_ctrl_c_in_the_last_step_saves_and_prints_no_resume_command(tmp_path):
    """A stop asked during the run's last step: saved, then evaluated (the final
    evaluation had been skipped: its record was missing from the metrics file for good),
    and no resume command (it would be refused: the checkpoint is already at --steps)."""
    d = tmp_path / "last"
    m = tmp_path / "m.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "train", "--model", "hslm-3",
                             "--batch", "32", "--threads", "1", "--steps", "1", "--out", str(d),
                             "--metrics", str(m), "--eval-windows", "3000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with running(proc, timeout=600):
        assert proc.stdout.readline().startswith("model ")  # the handlers are in; step 1 runs
        proc.send_signal(signal.SIGINT)
        while proc.poll() is None and not (d / "ckpt_1.state").exists():
            time.sleep(0.01)
        assert (d / "ckpt_1.state").exists(), proc.communicate()
        # saved before the evaluation (1.5-3 s here), as a stop in the steps is: a
        # scheduler's SIGKILL may follow its SIGTERM
        evaluated_first = [r[0] for r in metrics_records(m)] != ["train"]
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert not evaluated_first
    assert "stopped after step 1, the last; saved" in out and "resume with" not in out
    assert "step 1: valid " in out  # (the evaluation made is said)
    ckpt.read(d / "ckpt_1.state")
    assert [r[:2] for r in metrics_records(m)] == [("train", 1), ("eval", 1)]


def test_a_stop_at_a_step_due_an_evaluation_evaluates_it_first(tmp_path):
    """A stop after a step that --eval-every makes due had saved before evaluating it: the
    resumed run starts past that step, and its evaluation was lost for good. Now the
    stopped and resumed run's metrics are the uninterrupted run's (which is the control:
    before, one evaluation short)."""
    args = ["--model", "hslm-tiny", "--batch", "1", "--threads", "1", "--eval-every", "1",
            "--eval-windows", "2", "--log-every", "1"]
    stopped = tmp_path / "stopped.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "train", *args, "--steps",
                             "100000", "--out", str(tmp_path / "a"), "--metrics", str(stopped)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with running(proc, timeout=600):
        for line in proc.stdout:
            if line.startswith("step     5 "):
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    [state] = (tmp_path / "a").glob("ckpt_*.state")
    n = int(state.stem.split("_")[1])
    assert [r[:2] for r in metrics_records(stopped)[-2:]] == [("train", n), ("eval", n)]
    code, _, err = hslm("train", "--resume", state, "--steps", n + 2, "--eval-every", 1,
                        "--metrics", stopped)
    assert code == 0, err
    straight = tmp_path / "straight.jsonl"
    code, _, err = hslm("train", *args, "--steps", n + 2, "--out", tmp_path / "b",
                        "--metrics", straight)
    assert code == 0, err
    assert metrics_records(stopped) == metrics_records(straight)


def test_ctrl_c_during_the_final_evaluation_ends_as_a_stop(tmp_path):
    """A stop asked after the last step, during the final evaluation (here made long):
    the run evaluates and saves as it would have, then says it stopped and exits 130,
    as a stop asked in the last step does (it exited 0: `hslm train && next` went on)."""
    d = tmp_path / "evaluating"
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "train", "--model", "hslm-3",
                             "--batch", "1", "--threads", "1", "--steps", "1", "--log-every", "1",
                             "--eval-windows", "3000", "--out", str(d)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with running(proc, timeout=300):
        for line in proc.stdout:  # step 1 done: the final evaluation runs (about 3 s)
            if line.startswith("step "):
                break
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "SIGINT: stopped after step 1, the last; saved" in out and "resume with" not in out
    assert "first " not in out  # no summary line: the run ended as stopped
    ckpt.read(d / "ckpt_1.state")


def test_a_killed_runs_temporary_file_in_the_cache_folder_is_removed(base, tmp_path):
    """By train, and by eval and bench, whose --cache-dir (eval's default: the checkpoint's
    folder) may be used by nothing else: they had left it, as big as the text's tokens."""
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a PID no process holds now
    torn = cache / f".tokens-0123456789abcdef-0123456789abcdef.tok.tmp{dead.pid}"
    mine = cache / f".tokens-0123456789abcdef-0123456789abcdef.tok.tmp{os.getpid()}"
    mine.write_bytes(b"")  # a live writer's: left alone
    for cmd in (("train", *TINY, "--steps", 1, "--out", tmp_path / "o"),
                ("eval", base / "ckpt_2.bin"),
                ("bench", "--model", "hslm-tiny", "--speed", 3, "--threads", 1, "--batch", 2,
                 "--steps", 1, "--no-torch", "--no-profile")):
        torn.write_bytes(b"\0" * 4096)
        code, out, err = hslm(*cmd, "--cache-dir", cache)
        assert code == 0, err
        assert not torn.exists() and mine.exists(), cmd
    # never in a run's folder (its lock file there): only its run tidies it, holding the
    # lock (a writer in another PID namespace looks gone, and eval had removed a live
    # run's checkpoint while it was written). Control: the same folder without the lock
    run = tmp_path / "run"
    run.mkdir()
    for name in ("ckpt_2.bin", "ckpt_2.state", ".hslm.lock"):
        (run / name).write_bytes((base / name).read_bytes())
    torn = run / f".ckpt_3.bin.tmp{dead.pid}"
    for locked in (True, False):
        torn.write_bytes(b"\0" * 4096)
        if not locked:
            (run / ".hslm.lock").unlink()
        code, out, err = hslm("eval", run / "ckpt_2.bin")
        assert code == 0, err
        assert torn.exists() == locked


def test_eval_says_when_it_scores_another_text_than_the_runs(base, tmp_path):
    data = tmp_path / "t.txt"
    data.write_text(TEXT * 3)
    d = tmp_path / "own"
    assert hslm("train", *TINY, "--steps", 1, "--data", data, "--out", d)[0] == 0
    code, out, err = hslm("eval", d / "ckpt_1.bin")
    assert code == 0 and "note: scoring the built-in text" in err and "--data" in err
    code, out, err = hslm("eval", d / "ckpt_1.bin", "--data", data)
    assert code == 0 and "note:" not in err and "warning" not in err
    code, out, err = hslm("eval", base / "ckpt_2.bin")  # trained on the built-in text
    assert code == 0 and "note:" not in err
    # --data of another text (a folder whose files changed, say) had been scored unsaid
    other = tmp_path / "other.txt"
    other.write_text(TEXT * 2 + "and a line more\n")
    code, out, err = hslm("eval", d / "ckpt_1.bin", "--data", other)
    assert code == 0 and err == f"note: scoring another text than {d / 'ckpt_1.bin'} was " \
        "trained on (its .state records the text's sha256)\n", err


def test_a_bench_report_nested_too_deeply_is_one_line(tmp_path):
    """json recurses once a nesting level: '[' * 100000 was a RecursionError traceback."""
    good = ROOT / "docs" / "bench" / "threads.json"
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "\n")
    for args in ((good, deep), (deep, good)):
        line = one_line_error(*hslm("bench-compare", *args))
        assert f"{deep}: not a JSON bench report (nested too deeply)" in line, line
    # nested, but within what json reads: judged as a report, as before
    (tmp_path / "shallow.json").write_text("[" * 50 + "]" * 50)
    assert "not an hslm bench report" in one_line_error(
        *hslm("bench-compare", good, tmp_path / "shallow.json"))
    code, out, err = hslm("bench-compare", good, good)  # the good case still compares
    assert code == 0 and not err, err


def test_a_lock_path_that_is_not_a_regular_file_is_refused(tmp_path):
    """A FIFO at OUT/.hslm.lock was an ftruncate traceback (EINVAL); a FIFO opened for
    writing may wait for a reader: refused before it is opened, one line naming it."""
    d = tmp_path / "fifo"
    d.mkdir()
    os.mkfifo(d / ".hslm.lock")
    line = one_line_error(*hslm("train", *TINY, "--steps", 1, "--out", d))
    assert f"the lock file {d / '.hslm.lock'} is a FIFO, not a regular file" in line, line
    assert os.listdir(d) == [".hslm.lock"]  # nothing written, the FIFO left as it was
    for name, make, kind in (
            ("folder", lambda p: p.mkdir(), "a folder"),
            ("device", lambda p: p.symlink_to("/dev/null"), "a symbolic link"),
            ("dangling", lambda p: p.symlink_to(tmp_path / "missing"), "a symbolic link")):
        d = tmp_path / name
        d.mkdir()
        make(d / ".hslm.lock")
        with pytest.raises(HslmError, match=f"is {kind}, not a regular file"):
            FolderLock(d).acquire()
        assert not (tmp_path / "missing").exists()  # a dangling link creates nothing
    # the good cases: a stale regular lock file, and none at all
    d = tmp_path / "stale"
    d.mkdir()
    (d / ".hslm.lock").write_text("not a pid\n")
    lock = FolderLock(d).acquire()
    assert (d / ".hslm.lock").read_text() == f"{os.getpid()}\n"
    lock.release()
    FolderLock(tmp_path).acquire().release()


def _forged_state(src, dst, **meta_changes):
    """A valid .state: src's tensors and metadata, with meta_changes, re-encoded (so both
    checksums are right)."""
    ck = ckpt.read(src)
    meta = dict(ck.meta, **meta_changes)
    dst.write_bytes(ckpt.encode([(n, ck.tensor(n)) for n in ck.names()], meta))
    ckpt.read(dst)
    return dst


def test_a_checkpoints_data_source_is_printed_on_one_line_as_escapes(base, tmp_path):
    """data_source is the one free text of a checkpoint's: a crafted .state's newlines and
    terminal escapes had passed through hslm info and diff as they were (a line `checksum
    ok` of its own, colours). Control: the source as hslm writes it, as it is."""
    src = base / "ckpt_2.state"
    bad = _forged_state(src, tmp_path / "bad.state",
                        data_source="built-in x\n\x1b[31mRED\x1b[0m\nchecksum  ok")
    code, out, err = hslm("info", bad)
    assert code == 0, err
    [line] = [x for x in out.splitlines() if x.startswith("data ")]
    assert "built-in x\\n\\x1b[31mRED\\x1b[0m\\nchecksum  ok (text sha256" in line, line
    # C1's CSI and new line, the line separator and a right-to-left override as well
    c1 = _forged_state(src, tmp_path / "c1.state",
                       data_source="x\u009b2J\u0085y\u2028z\u202e!\u061c")
    code, out, err = hslm("info", c1)
    [line] = [x for x in out.splitlines() if x.startswith("data ")]
    assert code == 0 and "x\\x9b2J\\x85y\\u2028z\\u202e!\\u061c (text sha256" in line, line
    assert "\x1b" not in out and sum(x.startswith("checksum") for x in out.splitlines()) == 1
    code, out, err = hslm("diff", src, bad)
    assert code == 1 and "\x1b" not in out and "\\x1b[31mRED" in out, out
    code, out, err = hslm("info", src)
    source = ckpt.read(src).meta["data_source"]
    assert code == 0 and f"data      {source} (text sha256" in out, out


def test_info_says_a_checkpoint_holds_non_finite_values_and_huge_ones_are_short(base,
                                                                                tmp_path):
    """A consistent .bin (its checksums are of its bytes) may hold a NaN: hslm info had
    said `checksum ok` and shown the matrix as all zeros with alpha nan, where eval and
    sample refuse the file. It now says so. Values of 1e300 (a crafted file) were printed
    as 300-digit decimals by info (alpha) and eval (the loss). Control: a good file has no
    such line."""
    import numpy as np
    ck = ckpt.read(base / "ckpt_2.bin")
    tensors = [(n, ck.tensor(n).copy()) for n in ck.names()]
    dict(tensors)["Wout"].reshape(-1)[:2] = [np.nan, np.inf]
    (tmp_path / "nan").mkdir()
    (tmp_path / "nan" / "ckpt_2.bin").write_bytes(ckpt.encode(tensors, dict(ck.meta)))
    code, out, err = hslm("info", tmp_path / "nan" / "ckpt_2.bin")
    assert code == 0 and "checksum  ok" in out, err
    assert (f"values    2 of {dict(tensors)['Wout'].size:,} elements of Wout are NaN or "
            "infinite: eval, sample and --resume refuse this file") in out.splitlines(), out
    code, out, err = hslm("info", base / "ckpt_2.bin")
    assert code == 0 and "values " not in out and " alpha 0." in out, out

    tensors = [(n, ck.tensor(n) * (1e300 if n == "Wout" else 1)) for n in ck.names()]
    (tmp_path / "huge").mkdir()
    (tmp_path / "huge" / "ckpt_2.bin").write_bytes(ckpt.encode(tensors, dict(ck.meta)))
    code, out, err = hslm("info", tmp_path / "huge" / "ckpt_2.bin")
    [line] = [x for x in out.splitlines() if x.startswith("  Wout ")]
    assert code == 0 and line.split("alpha ")[1].endswith("e+298"), line
    code, out, err = hslm("eval", tmp_path / "huge" / "ckpt_2.bin")
    assert code == 0 and out.startswith("valid loss ") and "e+299, perplexity inf" in out, out


def test_diff_and_info_of_huge_values_and_of_nans_that_differ_in_their_bits(base, tmp_path):
    """A consistent .bin may hold finite values near 1e308: diff's differences and info's
    alpha overflowed to inf, and numpy's RuntimeWarning and its source line went to stderr.
    Two NaNs that differ in their bits (payload or sign) were shown as "nan vs nan": their
    bits are shown where the numbers print alike. Control: 0.0 against -0.0 as numbers."""
    import numpy as np
    ck = ckpt.read(base / "ckpt_2.bin")

    def forged(name, edit):
        tensors = [(n, ck.tensor(n).copy()) for n in ck.names()]
        edit(dict(tensors))
        (tmp_path / name).mkdir()
        path = tmp_path / name / "ckpt_2.bin"
        path.write_bytes(ckpt.encode(tensors, dict(ck.meta)))
        return path

    def put(name, *values):
        def edit(t):
            t[name].reshape(-1)[:len(values)] = values
        return edit

    nan2 = np.uint64(0x7FF8000000000001).view(np.float64)
    big, small = forged("big", put("bout", 1e308)), forged("small", put("bout", -1e308))
    wq = forged("wq", put("blocks.0.Wq", 1e308, 1e308, 1e308))
    nan_a, nan_b = forged("nan_a", put("bout", np.nan)), forged("nan_b", put("bout", nan2))
    plus, minus = forged("plus", put("bout", 0.0)), forged("minus", put("bout", -0.0))
    code, out, err = hslm("diff", big, small)
    assert code == 1 and err == "" and "max |diff| inf, first at [0] (1e+308 vs -1e+308)" in out
    code, out, err = hslm("info", wq)
    assert code == 0 and err == "", err
    code, out, err = hslm("diff", nan_a, nan_b)
    assert code == 1 and err == "", err
    assert ("first at [0] (nan 0x7ff8000000000000 vs nan 0x7ff8000000000001)" in out), out
    code, out, err = hslm("diff", plus, minus)
    assert code == 1 and "first at [0] (0.0 vs -0.0)" in out, out


def test_a_run_begun_before_the_decay_rule_is_still_read_and_resumed(base, tmp_path):
    """--decay-steps must be past --warmup for a new run; a .state of a run begun before
    the rule (warm-up 100, decay 50) had been refused whole by info, diff and --resume.
    Control: the same flags for a new run are refused."""
    src = base / "ckpt_2.state"
    hyper = json.loads(ckpt.read(src).meta["hyper"])
    old = tmp_path / "old" / "ckpt_2.state"
    old.parent.mkdir()
    (old.parent / "ckpt_2.bin").write_bytes((base / "ckpt_2.bin").read_bytes())
    _forged_state(src, old, hyper=json.dumps(dict(hyper, warmup=100, decay_steps=50),
                                             sort_keys=True, separators=(",", ":")))
    code, out, err = hslm("info", old)
    assert code == 0 and '"decay_steps":50' in out.replace(" ", ""), out + err
    code, out, err = hslm("train", "--resume", old, "--steps", 3, "--threads", 1)
    assert code == 0, err
    line = one_line_error(*hslm("train", *TINY, "--warmup", 100, "--decay-steps", 50,
                                "--out", tmp_path / "new"))
    assert "--decay-steps must be past --warmup's 100" in line


def test_a_state_whose_rng_is_not_written_as_hslm_writes_it_is_refused(base, tmp_path):
    """The .state's rng was the one field read whatever its spacing and key order (config,
    hyper and the tokenizer must be canonical): hslm diff then named no field ("the headers
    differ"), or, with a tensor changed too, only the tensor. Control: as written, read."""
    src = base / "ckpt_2.state"
    ck = ckpt.read(src)
    rng = ck.meta["rng"]
    spaced = tmp_path / "spaced.state"
    spaced.write_bytes(ckpt.encode([(n, ck.tensor(n)) for n in ck.names()],
                                   dict(ck.meta, rng=json.dumps(json.loads(rng)))))
    for cmd in (["info", spaced], ["diff", src, spaced], ["train", "--resume", spaced]):
        line = one_line_error(*hslm(*cmd))
        assert line.endswith("is not a valid hslm checkpoint: rng is not in canonical form"), line
    same = _forged_state(src, tmp_path / "same.state", rng=rng)
    code, out, err = hslm("diff", src, same)
    assert code == 0 and out.startswith("identical: "), out + err


def test_diff_and_info_read_a_bins_tokenizer_once(base, monkeypatch):
    """The tokenizer a .bin carries was made when the file was read, and again by
    Checkpoint.tokenizer() (a crafted one of 800,000 merges: 10 s for hslm info). Made
    once now, and the same object. Control: a .state carries none to make."""
    from hslm.data import Tokenizer
    made = []
    real = Tokenizer.from_json.__func__
    monkeypatch.setattr(Tokenizer, "from_json",
                        classmethod(lambda cls, s: made.append(1) or real(cls, s)))
    ck = ckpt.read(base / "ckpt_2.bin")
    assert len(made) == 1 and ck.tokenizer() is ck.tokenizer() and len(made) == 1
    state = ckpt.read(base / "ckpt_2.state")
    assert len(made) == 1
    with pytest.raises(ValueError, match="carries no tokenizer"):
        state.tokenizer()


def test_a_named_state_that_is_not_there_is_an_error(base, tmp_path):
    """eval and sample given a .state that is not there (a name mistyped, a link to
    nothing) had used the .bin beside it and scored it with the window's k, not the
    run's, saying nothing; a name with neither file was reported as the .bin. Control:
    the .bin named, it is used alone."""
    d = tmp_path / "alone"
    d.mkdir()
    (d / "ckpt_2.bin").write_bytes((base / "ckpt_2.bin").read_bytes())
    (d / "dangling.state").symlink_to(d / "nothing")
    (d / "lost.state").write_bytes((base / "ckpt_2.state").read_bytes())  # (no lost.bin)
    for cmd in (["eval"], ["sample", "--tokens", "2"]):
        for name, expect in (("ckpt_2.state", d / "ckpt_2.state"),
                             ("dangling.state", d / "dangling.state"),
                             ("typo.state", d / "typo.state"),
                             ("lost.state", f"{d / 'lost.bin'} (the parameters of "
                                            f"{d / 'lost.state'})")):
            line = one_line_error(*hslm(*cmd, d / name))
            assert line == f"error: checkpoint not found: {expect}", line
        code, out, err = hslm(*cmd, d / "ckpt_2.bin")
        assert code == 0, err


def test_diff_names_a_field_that_differs_only_as_minus_zero(base, tmp_path):
    """Two .state files whose hyper-parameters differ only in weight_decay 0.0 against
    -0.0 printed no field ("the headers differ: header_sha256 ..."): the fields were
    compared as Python values, and 0.0 == -0.0. They are compared by their JSON.
    Control: equal fields are not named."""
    src = base / "ckpt_2.state"
    hyper = json.loads(ckpt.read(src).meta["hyper"])
    a, b = [_forged_state(src, tmp_path / f"{name}.state", hyper=json.dumps(
        dict(hyper, weight_decay=value), sort_keys=True, separators=(",", ":")))
        for name, value in (("plus", 0.0), ("minus", -0.0))]
    code, out, err = hslm("diff", a, b)
    assert code == 1 and "  metadata hyper: weight_decay 0.0 != -0.0" in out, out
    assert len(out.splitlines()) == 3 and out.splitlines()[-1] == "0 tensor(s) differ", out
    # a nested field's value is shown as JSON, as the file holds it (the rng's state had
    # been shown as a Python dict: "...tate': 2954...")
    code, out, err = hslm("diff", base / "ckpt_1.state", src)
    rng = next(x for x in out.splitlines() if x.startswith("  metadata rng: state "))
    assert 'state":' in rng and "'" not in rng, rng


def test_a_weight_decay_of_minus_zero_is_stored_as_zero(tmp_path):
    """--weight-decay -0 trains the run --weight-decay 0 does, so its .state is the same:
    the flag's -0.0 had been stored as it was, and the two runs' .state files differed
    (diff: "weight_decay 0.0 != -0.0"). Control: the flag 0 stores 0.0."""
    states = []
    for name, value in (("minus", "-0"), ("plus", "0")):
        code, out, err = hslm("train", *TINY, "--steps", 1, "--seed", 1, "--weight-decay",
                              value, "--out", tmp_path / name)
        assert code == 0, err
        state = tmp_path / name / "ckpt_1.state"
        assert '"weight_decay":0.0' in ckpt.read(state).meta["hyper"]
        states.append(state.read_bytes())
    assert states[0] == states[1]


def test_diff_names_params_sha256_and_not_the_header_checksum(base, tmp_path, monkeypatch):
    """Two .state files differing only in params_sha256 printed only
    `metadata header_sha256: ...` (derived from the rest: noise) and 0 tensors."""
    a = base / "ckpt_2.state"
    b = _forged_state(a, tmp_path / "forged.state", params_sha256="0" * 64)
    code, out, err = hslm("diff", a, b)
    assert code == 1 and not err, err
    pa = ckpt.read(a).meta["params_sha256"]
    assert f"  metadata params_sha256: {pa[:24]}... (64 chars) != {'0' * 24}..." in out, out
    assert "header_sha256" not in out and "data_sha256" not in out
    assert out.splitlines()[-1] == "0 tensor(s) differ"
    # two real states: the fields and tensors that differ, and still no header checksum
    code, out, err = hslm("diff", base / "ckpt_1.state", a)
    assert code == 1 and "metadata step: 1 != 2" in out and "metadata params_sha256:" in out
    assert "adam.m:" in out and "header_sha256" not in out
    code, out, err = hslm("diff", a, a)  # identical: exit 0, as before
    assert code == 0 and out.startswith("identical: ")
    # headers that differ only in header_sha256 (not possible in files that pass the
    # checks): the difference is still said
    from hslm import inspect as hslm_inspect
    real = ckpt.read

    def read(path, expect_kind=None):
        ck = real(a, expect_kind)
        if path == "other":
            ck.head += b" "
            ck.meta["header_sha256"] = "f" * 64
        return ck
    monkeypatch.setattr(hslm_inspect.ckpt, "read", read)
    same, lines = hslm_inspect.diff_checkpoints("a", "other")
    assert not same and lines[1].startswith("  the headers differ: header_sha256 "), lines
    assert lines[-1] == "0 tensor(s) differ"


def test_plot_refuses_a_folder_fifo_or_device_before_drawing(tmp_path):
    """-o a FIFO said `cannot write ff.png: None`, -o a folder complained about its
    extension: each is now named for what it is (no matplotlib needed to say so)."""
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"kind": "train", "step": 1, "loss": 5.0}) + "\n")
    fifo = tmp_path / "ff.png"
    os.mkfifo(fifo)
    (tmp_path / "outdir").mkdir()
    (tmp_path / "dir.png").mkdir()
    for out, expect in ((fifo, "is a FIFO, not a regular file"),
                        (tmp_path / "outdir", "is a folder"), (tmp_path / "dir.png", "is a folder"),
                        ("/dev/null", "is a device, not a regular file")):
        line = one_line_error(*hslm("plot", m, "-o", out))
        assert line.startswith(f"error: -o {out} {expect}"), line
    assert sorted(os.listdir(tmp_path)) == ["dir.png", "ff.png", "m.jsonl", "outdir"]
    assert os.listdir(tmp_path / "dir.png") == [] and os.path.exists("/dev/null")


def test_a_runs_own_inputs_are_not_its_outputs(tmp_path):
    """Found by a review helper, each had exit 0: --metrics appended to the run's --model
    config (or any file of lines: it then read as neither; now a metrics file must end in
    a record of hslm's), a --data file or --model
    config in --out named as a file the run writes (tokenizer.json, ckpt_1.bin) was
    replaced by it (and the run could not be resumed on its text), bench --json replaced
    a checkpoint or a run's lock, and plot -o naming its metrics file replaced the records
    with the image. Each refused before anything is written, the file intact. Controls: a
    metrics file of records is appended to; bench --json replaces its earlier report."""
    from hslm.config import PRESETS
    text = tmp_path / "t.txt"
    text.write_text((ROOT / "README.md").read_text(encoding="utf-8")[:40000])
    cfg = tmp_path / "m.json"
    cfg.write_text(PRESETS["hslm-tiny"].to_json() + "\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "tokenizer.json").write_bytes(text.read_bytes())
    (inside / "ckpt_1.bin").write_bytes(cfg.read_bytes())
    kept = {f: f.read_bytes() for f in (text, cfg, notes, *inside.iterdir())}
    run = ["train", "--data", text, "--steps", 1, "--threads", 1, "--eval-windows", 2]
    for args, expect in (
            (["--model", cfg, "--metrics", cfg, "--out", tmp_path / "o"],
             f"--metrics {cfg} is not a metrics file (its last line is no record"),
            (["--model", cfg, "--metrics", notes, "--out", tmp_path / "o"],
             f"--metrics {notes} is not a metrics file (its last line is no record"),
            (["--model", "hslm-tiny", "--data", inside / "tokenizer.json", "--out", inside],
             f"--data {inside / 'tokenizer.json'} has a name this run writes in its output "
             f"folder {inside}"),
            (["--model", inside / "ckpt_1.bin", "--out", inside],
             f"--model {inside / 'ckpt_1.bin'} has a name this run writes")):
        line = one_line_error(*hslm(*run, *args))
        assert expect in line, line
    assert {f: f.read_bytes() for f in kept} == kept and not (tmp_path / "o").exists()
    code, out, err = hslm(*run, "--model", cfg, "--out", tmp_path / "o", "--metrics",
                          tmp_path / "m.svg")
    assert code == 0, err
    line = one_line_error(*hslm("plot", tmp_path / "m.svg", "-o", tmp_path / "m.svg"))
    assert f"-o {tmp_path / 'm.svg'} is the metrics file" in line
    with open(tmp_path / "m.svg", "a") as f:  # a user's note: a record of another kind
        f.write('{"kind": "note", "text": "lr changed"}\n\n')
    code, out, err = hslm(*run, "--model", cfg, "--out", tmp_path / "o2", "--metrics",
                          tmp_path / "m.svg")
    assert code == 0 and "already holds records" in err, err
    bench = ["bench", "--model", "hslm-tiny", "--data", text, "--speed", "3", "--steps", 1,
             "--no-torch", "--no-profile", "--json"]
    ck = tmp_path / "o" / "ckpt_1.bin"
    for target in (ck, tmp_path / "o" / ".hslm.lock"):
        target.touch()
        before = target.read_bytes()
        line = one_line_error(*hslm(*bench, target))
        assert f"--json {target} is a file that is not a bench report" in line, line
        assert target.read_bytes() == before
    report = tmp_path / "r.json"
    for _ in range(2):
        code, out, err = hslm(*bench, report)
        assert code == 0 and json.loads(report.read_text())["models"], err


def test_a_standard_output_that_fails_is_named_and_the_new_folder_removed(tmp_path):
    """A standard output on a full disk (/dev/full) had read as the checkpoints' disk's
    ("error: No space left on device"), and the run left the folder it made (its lock,
    caches and tokenizer) with nothing trained. Control: with -q the run writes nothing
    there until its last line, and its checkpoint is kept."""
    text = tmp_path / "t.txt"
    text.write_text((ROOT / "README.md").read_text(encoding="utf-8")[:40000])
    run = [sys.executable, str(ROOT / "cli.py"), "train", *TINY, "--data", str(text),
           "--steps", "1", "--eval-windows", "2", "--out"]
    with open("/dev/full", "w") as full:
        p = subprocess.run(run + [str(tmp_path / "o")], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=300)
        assert p.returncode == 2 and p.stderr.splitlines()[-1] == (
            "error: the standard output: No space left on device"), p.stderr
        assert "Traceback" not in p.stderr and not (tmp_path / "o").exists()
        p = subprocess.run(run + [str(tmp_path / "q"), "-q"], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    ckpt.read(tmp_path / "q" / "ckpt_1.bin")


def test_memory_is_judged_against_the_control_groups_limit(tmp_path, monkeypatch):
    """The memory check read MemAvailable alone: in a container held to less (a control
    group's limit), a run it let start was killed by the kernel, with no line. The least
    headroom over the process's group and those above it counts, its inactive page cache
    as free (a group whose memory.stat is not read, without it); a group folder not seen
    (a container's own group is its root) is passed over. Control: groups without a limit
    leave the machine's figure."""
    from hslm import validate
    root = tmp_path / "cg"
    mib = 1 << 20

    def group(folder, limit, used, cache, v2=True):
        folder.mkdir(parents=True, exist_ok=True)
        names = (("memory.max", "memory.current", "") if v2 else
                 ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_"))
        (folder / names[0]).write_text(f"{limit}\n")
        (folder / names[1]).write_text(f"{used}\n")
        (folder / "memory.stat").write_text(  # the page cache, half of it active
            f"anon 5\n{names[2]}active_file {cache // 2}\n{names[2]}inactive_file "
            f"{cache - cache // 2}\nfile 9\n")

    own = tmp_path / "cgroup"
    monkeypatch.setattr(validate, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(validate, "CGROUP_OF_PROCESS", str(own))
    own.write_text("0::/a/b\n")
    group(root / "a", 1024 * mib, 600 * mib, 100 * mib)  # 524 MiB left
    group(root / "a" / "b", "max", 600 * mib, 0)
    assert validate.cgroup_headroom() == 524 * mib
    assert validate.available_memory() == 524 * mib
    (root / "a" / "memory.stat").unlink()
    assert validate.cgroup_headroom() == 424 * mib  # (the limit still holds)
    group(root / "a", 1024 * mib, 600 * mib, 100 * mib)
    group(root / "a" / "b", 2048 * mib, 2000 * mib, 1000 * mib)  # 1048 left: a's is less
    assert validate.cgroup_headroom() == 524 * mib
    own.write_text("4:memory:/host/path/not/seen\n1:cpu:/\n")  # v1, its folder the root
    group(root / "memory", 8192 * mib, 4096 * mib, 0, v2=False)
    assert validate.cgroup_headroom() == 4096 * mib
    with pytest.raises(HslmError, match="needs about 5.0 GiB of memory, but only 4.0 GiB"):
        validate.check_fits(5 << 30, "a run")
    # v2's reclaimable slab (dentries, inodes) is taken back too, as MemAvailable counts it
    group(root / "a", 1024 * mib, 600 * mib, 100 * mib)
    with open(root / "a" / "memory.stat", "a") as f:
        f.write(f"slab_reclaimable {200 * mib}\n")
    own.write_text("0::/a/b\n")
    assert validate.cgroup_headroom() == 724 * mib
    own.write_text("4:memory:/host/path/not/seen\n1:cpu:/\n")
    # a kernel before 3.14 has no MemAvailable: the physical memory (it had become 2^62)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:        500 kB\n")
    monkeypatch.setattr(validate, "MEMINFO", str(meminfo))
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert validate.available_memory() == min(physical, 4096 * mib)
    group(root / "memory", 2 ** 63 - 4096, 4096 * mib, 0, v2=False)  # v1's "no limit"
    (root / "a" / "memory.max").write_text("max\n")
    own.write_text("0::/a/b\n4:memory:/\nnot a line of cgroup's\n")
    (root / "a" / "b" / "memory.max").write_text("max\n")
    assert validate.cgroup_headroom() == 1 << 62
    assert validate.available_memory() == physical


def test_memory_is_judged_against_the_address_space_limit(tmp_path):
    """Under `ulimit -v` a run the memory check let start failed after its text was read
    ("out of memory"), its new folder left. It is refused first, in one line. Control:
    the same run with the limit, at a batch that fits it, trains."""
    import resource
    limit = 3 << 30  # (the need below: 3.2 GiB)
    run = [sys.executable, str(ROOT / "cli.py"), "train", *TINY, "--steps", "1",
           "--eval-windows", "2", "--out", str(tmp_path / "o")]

    def with_limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    p = subprocess.run(run + ["--batch", "20000"], capture_output=True, text=True,
                       timeout=300, preexec_fn=with_limit)
    line = one_line_error(p.returncode, p.stdout, p.stderr)
    assert "with --batch 20000 on 1 thread(s) needs about" in line, line
    assert float(line.split("but only ")[1].split(" GiB")[0]) < 3.0
    assert not (tmp_path / "o").exists()
    p = subprocess.run(run, capture_output=True, text=True, timeout=300, preexec_fn=with_limit)
    assert p.returncode == 0, p.stderr


def test_a_warning_names_a_path_on_one_line(tmp_path):
    """Errors printed a path's newlines and escapes as escapes (one_line), warnings as they
    were: a --metrics name with a newline forged a line of its own. Control: an error."""
    metrics = tmp_path / "m\nwarning: forged.jsonl"
    metrics.write_text(json.dumps({"kind": "train", "step": 1}) + "\n")
    code, out, err = hslm("train", *TINY, "--steps", 1, "--eval-windows", 2, "--out",
                          tmp_path / "o", "--metrics", metrics)
    assert code == 0 and err.count("\n") == 1, err
    assert err.startswith(f"warning: --metrics {tmp_path}/m\\nwarning: forged.jsonl already "), err


def test_bench_json_that_is_not_a_regular_file_is_refused_before_benchmarking(tmp_path):
    """bench --json a FIFO (or /dev/null) reported "wrote" and put a file in the node's
    place: now refused up front, as plot -o and --metrics are."""
    from hslm.checkpoint import check_atomic_target
    from hslm.errors import HslmError
    fifo = tmp_path / "ff.json"
    os.mkfifo(fifo)
    line = one_line_error(*hslm("bench", "--model", "hslm-tiny", "--steps", 1, "--no-torch",
                                "--no-profile", "--json", fifo))
    assert line == f"error: --json {fifo} is a FIFO, not a regular file; give a file name"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    for device in ("/dev/null", "/dev/full"):  # judged, never written (a refusal writes nothing)
        with pytest.raises(HslmError, match=f"--json {device} is a device, not a regular file"):
            check_atomic_target(device, "--json")
        assert stat.S_ISCHR(os.stat(device).st_mode)
    check_atomic_target(tmp_path / "new.json", "--json")  # a new name in a writable folder


def test_plot_writes_its_image_atomically(tmp_path, monkeypatch):
    """The image was saved straight onto -o: a failed write left half an image there.
    Now it goes to a temporary file in the same folder, renamed onto the name."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from hslm.plot import plot_metrics
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 5.0 / s}) + "\n"
                         for s in range(1, 5)))
    out = tmp_path / "loss.png"
    out.write_bytes(b"the old image")
    keep = tmp_path / "keep.png"
    os.link(out, keep)  # written in place, the old file's other name would change too
    code, stdout, err = hslm("plot", m, "-o", out)
    assert code == 0, err
    assert out.read_bytes().startswith(b"\x89PNG") and keep.read_bytes() == b"the old image"
    assert sorted(os.listdir(tmp_path)) == ["keep.png", "loss.png", "m.jsonl"]
    # a write that fails half way (a full disk): the old image is left whole, no debris
    old = out.read_bytes()

    def full_disk(self, fname, **kw):
        if isinstance(fname, (str, os.PathLike)):
            with open(fname, "wb") as f:
                f.write(b"\x89PNG half")
        else:
            fname.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(HslmError, match="No space left on device"):
        plot_metrics(m, out)
    assert out.read_bytes() == old
    assert sorted(os.listdir(tmp_path)) == ["keep.png", "loss.png", "m.jsonl"]


def test_odd_temporary_names_are_left_alone_not_a_traceback(tmp_path):
    """remove_torn_writes reads a pid from `.<name>.tmp<pid>`: one os.kill cannot take
    (over a C long, or a digit that is not ASCII) stopped `hslm train` with a traceback.
    Only the names hslm writes are its torn writes."""
    from hslm.train import remove_torn_writes
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    odd = [".ckpt_1.bin.tmp99999999999999999999", ".ckpt_1.bin.tmp12345678901",
           ".ckpt_1.bin.tmp\u00b2", ".ckpt_1.bin.tmp0", ".ckpt_1.bin.tmp",
           # a user's files that are not hslm's, in a --cache-dir of theirs, say (removed
           # before: any `.X.tmpN` of a dead pid was taken for a torn write)
           f".notes.tmp{dead.pid}", f".bashrc.tmp{dead.pid}", f".tokenizer.json.tmp{dead.pid}x"]
    torn = [f".{n}.tmp{dead.pid}" for n in ("ckpt_3.bin", "ckpt_3.state", "tokenizer.json",
                                             "bpe-ab.json", "tokens-ab.tok", "text-sha256.json")]
    for n in odd + torn:
        (tmp_path / n).write_bytes(b"x")
    remove_torn_writes(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(odd)  # a dead writer's alone removed


def test_an_interrupted_write_leaves_no_temporary_file(tmp_path):
    """A second Ctrl-C mid-save (KeyboardInterrupt, not an OSError) left the temporary file."""
    def parts(exc):
        yield b"first part "
        raise exc

    target = tmp_path / "ckpt_7.bin"
    with pytest.raises(KeyboardInterrupt):
        ckpt.write_atomic(target, parts(KeyboardInterrupt()))
    assert os.listdir(tmp_path) == []
    with pytest.raises(HslmError, match="cannot write checkpoint"):  # (as before)
        ckpt.write_atomic(target, parts(OSError(28, "No space left on device")))
    assert os.listdir(tmp_path) == []
    ckpt.write_atomic(target, [b"whole"])
    assert os.listdir(tmp_path) == ["ckpt_7.bin"] and target.read_bytes() == b"whole"


def test_a_link_at_the_temporary_name_is_not_written_through(tmp_path):
    """The temporary file is made anew (O_EXCL): a symbolic link planted under its name
    in a shared folder does not get its target truncated."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (tmp_path / "out").mkdir()
    for name in (f".ckpt_1.bin.tmp{os.getpid()}", f".ckpt_1.bin.probe{os.getpid()}"):
        os.symlink(victim, tmp_path / "out" / name)
    ckpt.check_atomic_target(tmp_path / "out" / "ckpt_1.bin", "--out")
    ckpt.write_atomic(tmp_path / "out" / "ckpt_1.bin", b"checkpoint")
    assert victim.read_bytes() == b"keep me"
    assert os.listdir(tmp_path / "out") == ["ckpt_1.bin"]
    assert (tmp_path / "out" / "ckpt_1.bin").read_bytes() == b"checkpoint"


def test_new_folders_are_made_durable_in_their_parents(tmp_path, monkeypatch):
    """write_atomic(make_parent=True) fsyncs the parent of each folder it makes (a file
    renamed into a new folder is lost with the folder's own entry), then the folder."""
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                  fsync(fd)))
    ckpt.write_atomic(tmp_path / "a" / "b" / "ckpt_1.bin", b"x", make_parent=True)
    folders = [p for p in synced if os.path.isdir(p)]
    assert folders == [str(tmp_path), str(tmp_path / "a"), str(tmp_path / "a" / "b")], synced
    with pytest.raises(HslmError, match="not a folder"):
        ckpt.write_atomic(tmp_path / "a" / "b" / "ckpt_1.bin" / "c" / "x", b"x", make_parent=True)


def test_a_failed_run_removes_its_folder_before_letting_go_of_it():
    """Released first, another run could take the folder in the gap and lose it."""
    from hslm.train import releasing_on_error
    calls = []
    held = types.SimpleNamespace(release=lambda: calls.append("release"),
                                 remove_created=lambda: calls.append("remove"))
    with pytest.raises(KeyboardInterrupt):
        with releasing_on_error([held]):
            raise KeyboardInterrupt
    assert calls == ["remove", "release"]


@pytest.mark.parametrize("record,why", [
    ('{"kind": "train", "step": 1e999, "loss": 1.0}', "its step, Infinity, is not a whole"),
    ('{"kind": "train", "step": 2.7, "loss": 1}', "its step, 2.7, is not a whole number"),
    ('{"kind": "train", "step": true, "loss": 1.0}', "its step, true, is not a whole number"),
    ('{"kind": "train", "step": -1, "loss": 1.0}', "its step, -1, is not a whole number from 0"),
    pytest.param('{"kind": "train", "step": 1, "loss": ' + "9" * 400 + "}",
                 "its loss, " + "9" * 37 + "..., is past a double's range",
                 id="long-loss"),
    ('{"kind": "eval", "step": 1, "valid_loss": "3"}', 'its valid_loss, "3", is not a number'),
    ('{"kind": "train", "step": 1, "loss": true}', "its loss, true, is not a number"),
    ('{"kind": "train", "loss": 1.0}', "no 'step' field"),
    ('{"kind": "train", "step": 1, "loss": 1.0', "not JSON"),
    ('["kind", "train"]', "not a JSON object"),
    pytest.param("[" * 100000, "JSON nested too deep", id="nested"),
    pytest.param('{"kind": "train", "step": 1, "loss": ' + "9" * 5000 + "}",
                 "a number of more digits than Python reads"
                 if hasattr(sys, "get_int_max_str_digits") else "its loss, ",  # (3.10.7+)
                 id="longer-loss"),
])
def test_a_metrics_line_hslm_never_writes_is_one_line(tmp_path, record, why):
    """hslm plot: OverflowError and RecursionError tracebacks before, and a step of 2.7
    or true or a loss of "3" half-believed (as 2, 1 and 3.0). The line says what is
    wrong with the record (it had said only that it was not one)."""
    m = tmp_path / "m.jsonl"
    m.write_text('{"kind": "train", "step": 0, "loss": 6.5}\n' + record + "\n")
    line = one_line_error(*hslm("plot", m, "-o", tmp_path / "p.png"))
    assert f"{m}:2 is not a metrics record ({why}" in line, line


def test_a_diverged_runs_metrics_still_plot(tmp_path):
    """The control: hslm train writes NaN (json's NaN) for a loss that diverged."""
    pytest.importorskip("matplotlib")
    m = tmp_path / "m.jsonl"
    m.write_text('{"kind": "train", "step": 1, "loss": 6.5}\n{"kind": "train", "step": 2, '
                 '"loss": NaN}\n{"kind": "eval", "step": 2, "valid_loss": Infinity}\n')
    code, out, err = hslm("plot", m, "-o", tmp_path / "p.png")
    assert code == 0 and (tmp_path / "p.png").exists(), err


def test_an_os_error_the_checks_did_not_foresee_is_one_line(tmp_path):
    """A name too long for the file system reached pathlib's checks as an OSError
    traceback (info, --model, --out). (A token cache folder of such a name, which had
    stopped the run here and left the output folder's lock behind, is now a warning as any
    cache folder that cannot be written: test_a_cache_folder_of_a_name_too_long_is_a_warning.)"""
    long = "a" * 300
    for args in (("info", tmp_path / long), ("train", "--model", tmp_path / long),
                 ("train", *TINY, "--steps", 1, "--out", tmp_path / long)):
        assert "File name too long" in one_line_error(*hslm(*args))


@pytest.mark.parametrize("command,name,allowed", [
    (("train", "--model"), "big.json", "65,536"), (("plot",), "m.jsonl", "1,073,741,824"),
    (("bench-compare", ROOT / "docs" / "bench" / "threads.json"), "r.json", "67,108,864"),
])
def test_a_huge_small_file_is_refused_by_its_size_before_it_is_read(tmp_path, command, name,
                                                                     allowed):
    """A --model JSON of 3 GB was read whole (15 s, then a memory error where memory is
    short) before its size was judged; so were metrics files and bench reports."""
    big = tmp_path / name
    with open(big, "wb") as f:
        f.truncate(3 << 30)  # (sparse: no disk used)
    line = one_line_error(*hslm(*command, big))
    assert f"is 3,221,225,472 bytes, more than the {allowed} allowed" in line, line


def test_diff_sample_and_validation_windows_hold_no_copy_that_grows(base, monkeypatch):
    """Memory that grew with the input, in no estimate (a review measured each): diff
    compared whole tensors (a mask and three float64 copies of the differing elements:
    2.4 GB for two .state files of 1.5 GB), sample kept every id it drew, and the
    validation windows were a list of one view each (about 1 KB a window: 4.4 GB for a
    large text). Now diff goes a chunk at a time with the same lines, sample keeps only the
    window's context when it streams, and the windows are gathered by one index, with the
    same values. Measured with tracemalloc; each has its control."""
    import tracemalloc
    from hslm import inspect as hslm_inspect
    from hslm.data import Corpus
    from hslm.sample import sample as sample_ids
    from hslm.speeds import DEFAULT_SPEED
    from hslm.step import Worker

    def traced(work):
        tracemalloc.start()
        try:
            result = work()
            return result, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    a, b = base / "ckpt_1.state", base / "ckpt_2.state"  # every moment differs
    P = ckpt.read(a).config.n_params
    whole, whole_peak = traced(lambda: hslm_inspect.diff_checkpoints(a, b))
    monkeypatch.setattr(hslm_inspect, "DIFF_CHUNK", 1000)
    chunked, chunked_peak = traced(lambda: hslm_inspect.diff_checkpoints(a, b))
    assert chunked == whole and any(line.startswith("  adam.m: ") for line in whole[1])
    assert chunked_peak < 2 * 16 * P + 4 * P, (chunked_peak, P)  # the two files, and a little
    assert whole_peak > 2 * 16 * P + 12 * P, whole_peak  # (control: whole tensors' copies)

    cfg, state, tok, _ = load_for_inference(base / "ckpt_2.bin")
    worker = Worker(cfg, DEFAULT_SPEED)
    drawn = {}
    for n in (100, 1100):
        seen = []
        out, drawn[n] = traced(lambda: sample_ids(
            worker, state.kernel_model(), state.tables.vsa, tok.encode("the "), n, 0.8, 40, 3,
            cfg.window, each=seen.append))
        assert out == [] and len(seen) == n
    assert drawn[1100] - drawn[100] < 4096, drawn  # not 16-44 bytes a token
    kept = sample_ids(worker, state.kernel_model(), state.tables.vsa, tok.encode("the "), 1100,
                      0.8, 40, 3, cfg.window)
    assert kept == seen  # (control: without each, the ids are returned, the same ones)

    text = "".join(f"line {i}: the quick brown fox {i % 7} jumps over {i % 13} lazy dogs.\n"
                   for i in range(30000))
    corpus = Corpus(text, cfg.vocab, cfg.window, "test text", tokenizer=tok)
    L = cfg.window
    windows, peak = traced(lambda: corpus.validation_windows(10 ** 9, L))
    c = len(windows)
    assert c > 5000 and peak < 20 * c * (L + 1), (c, peak)  # (a list of views: 30)
    n_win = (len(corpus.valid) - 1) // L
    assert c == n_win and windows.dtype == np.int64
    old = np.stack([corpus.valid[i * L:i * L + L + 1] for i in range(c)]).astype(np.int64)
    assert np.array_equal(windows, old)  # (control: the list of views gave these values)


@pytest.mark.parametrize("name,value", [
    ("HSLM_MPI", "banana"), ("HSLM_MPI", "true"), ("HSLM_MPI_SHARED", "yes"),
    ("HSLM_MPI_START_NOTICE", "abc"), ("HSLM_MPI_START_NOTICE", "nan"),
    ("HSLM_MPI_START_NOTICE", "-1"), ("HSLM_MPI_START_NOTICE", "inf"),
])
def test_an_mpi_switch_set_to_a_value_it_does_not_have_is_refused(base, monkeypatch, name,
                                                                  value):
    """HSLM_MPI=yes had run one process without a word (only 0 and 1 mean anything), and
    a start notice of abc had waited the default 60 s: one line, any command, MPI or not."""
    monkeypatch.setenv(name, value)
    line = one_line_error(*hslm("info", base / "ckpt_2.bin"))
    assert f"{name} must be" in line and repr(value) in line, line


@pytest.mark.parametrize("name,value", [
    ("HSLM_MPI", "0"), ("HSLM_MPI", ""), ("HSLM_MPI_SHARED", "0"), ("HSLM_MPI_SHARED", "1"),
    ("HSLM_MPI_START_NOTICE", "0"), ("HSLM_MPI_START_NOTICE", "2.5"),
])
def test_an_mpi_switch_with_a_documented_value_is_taken(base, monkeypatch, name, value):
    """The control: the values the README gives (and empty, as unset) go through."""
    monkeypatch.setenv(name, value)
    code, out, err = hslm("info", base / "ckpt_2.bin")
    assert code == 0 and "must be" not in err, err


@pytest.mark.parametrize("suffix", [".bin", ".state"])
def test_a_checkpoint_given_as_model_points_to_resume(base, tmp_path, suffix):
    """--model ckpt_2.bin had been judged as a JSON config: "more than the 65,536 bytes
    allowed" (or "unknown --model"), true but no help."""
    line = one_line_error(*hslm("train", "--model", base / f"ckpt_2{suffix}", "--steps", 1,
                                "--out", tmp_path / "o", cwd=tmp_path))
    assert "is an hslm checkpoint, not a model config" in line, line
    assert line.endswith(f"--resume {base / 'ckpt_2.state'}"), line
    assert not (tmp_path / "o").exists()


def test_a_text_file_given_as_a_checkpoint_is_called_text(base, tmp_path):
    """`hslm info notes.txt` had called a text file damaged, its first 8 bytes read as a
    header length of 8e18; a checkpoint cut short is still damaged (the control: its
    first bytes are a real length, not text)."""
    text = tmp_path / "notes.txt"
    text.write_text("hello world, these are notes\n")
    line = one_line_error(*hslm("info", text))
    assert line == (f"error: {text} is not an hslm checkpoint: it begins with text "
                    "('hello wo'), where a checkpoint begins with the length of its header")
    # a UTF-8 text that does not begin with ASCII (it had been called damaged, a header
    # length of 1e19), its 8 bytes cutting a character: the whole ones shown
    for words, shown in (("été: les notes", "été: l"), ("中文文本", "中文"),
                         ("\ufeffhello world", "hello")):  # (a byte order mark read past)
        text.write_text(words, encoding="utf-8")
        line = one_line_error(*hslm("info", text))
        assert f"is not an hslm checkpoint: it begins with text ('{shown}')" in line, line
    cut = tmp_path / "cut.bin"
    cut.write_bytes((base / "ckpt_2.bin").read_bytes()[:100])
    line = one_line_error(*hslm("info", cut))
    assert "is damaged" in line and "not an hslm checkpoint: it begins with text" not in line


def test_a_save_that_fails_leaves_the_checkpoint_it_would_replace_whole(tmp_path):
    """A checkpoint is a pair: the .bin was renamed over the old one before the .state
    was written, so a save that failed on its .state (a full disk; here a file-size
    limit between the two files' sizes) left a new .bin beside the old .state, and
    neither run's step 2 could be resumed. Now both are written before either is
    renamed: the old pair is left whole, and resumes."""
    import resource
    d = tmp_path / "rp"
    code, out, err = hslm("train", *TINY, "--steps", "2", "--out", d, "--quiet")
    assert code == 0, err
    old = {n: (d / n).read_bytes() for n in ("ckpt_2.bin", "ckpt_2.state")}
    assert len(old["ckpt_2.bin"]) < len(old["ckpt_2.state"])  # (the limit falls between)
    limit = (len(old["ckpt_2.bin"]) + len(old["ckpt_2.state"])) // 2
    p = subprocess.run([sys.executable, str(ROOT / "cli.py"), "train", *map(str, TINY),
                        "--steps", "2", "--seed", "5", "--out", str(d), "--quiet"],
                       capture_output=True, text=True, timeout=600,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE,
                                                             (limit, limit)))
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert p.stderr.splitlines()[-1].startswith("error: cannot write checkpoint "), p.stderr
    assert {n: (d / n).read_bytes() for n in old} == old
    assert not [f.name for f in d.iterdir() if ".tmp" in f.name]
    code, out, err = hslm("train", "--resume", d / "ckpt_2.state", "--steps", "3", "--quiet")
    assert code == 0, err
    # (the control: a save that fits replaces the pair)
    code, out, err = hslm("train", *TINY, "--steps", "2", "--seed", "5", "--out", d, "--quiet")
    assert code == 0 and (d / "ckpt_2.bin").read_bytes() != old["ckpt_2.bin"], err


def test_a_run_that_fails_before_training_removes_only_the_folders_it_made_and_holds(tmp_path):
    """A run removes the output folder it made when it fails before training (a bad
    text, Ctrl-C while tokenizing). It removed the topmost folder it had made by name:
    another run started meanwhile with --out beside its own, under that folder, lost
    its checkpoints, as did a run that took the name of the folder once moved away."""
    from hslm.train import hold_out_dir
    held = hold_out_dir(tmp_path / "sweep" / "a")  # sweep made by this run
    (tmp_path / "sweep" / "b").mkdir()  # another run's, since
    (tmp_path / "sweep" / "b" / "ckpt_1.bin").write_bytes(b"theirs")
    held.remove_created()
    held.release()
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["b"]
    assert (tmp_path / "sweep" / "b" / "ckpt_1.bin").read_bytes() == b"theirs"
    held = hold_out_dir(tmp_path / "x")
    (tmp_path / "x").rename(tmp_path / "x.old")  # moved away; another run takes the name
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "ckpt_1.bin").write_bytes(b"theirs")
    held.remove_created()
    held.release()
    assert (tmp_path / "x" / "ckpt_1.bin").read_bytes() == b"theirs"
    # the control: alone, every folder the run made is removed
    held = hold_out_dir(tmp_path / "new" / "deeper" / "out")
    held.remove_created()
    held.release()
    assert not (tmp_path / "new").exists()


MOVED_WHILE_TOKENIZING = """
import os, sys
from hslm import train
from hslm.cli import main
out = sys.argv[1]
load = train.load_corpus
def load_then_move(*args, **kwargs):
    corpus = load(*args, **kwargs)
    os.rename(out, out + ".old")  # the user moves the folder; another run takes the name
    os.mkdir(out)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        f.write("theirs")
    return corpus
train.load_corpus = load_then_move
sys.argv = ["hslm", "train", "--model", "hslm-tiny", "--batch", "2", "--threads", "1",
            "--steps", "1", "--out", out]
main()
"""


def test_a_folder_moved_while_the_text_is_read_gets_the_tokenizer_not_the_new_one(tmp_path):
    """tokenizer.json was written by the folder's name, so a run whose folder was moved
    while it read its text replaced the tokenizer.json of the run that took the name;
    it goes into the folder the run holds, as its checkpoints do."""
    out = tmp_path / "m"
    p = subprocess.run([sys.executable, "-c", MOVED_WHILE_TOKENIZING, str(out)],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = one_line_error(p.returncode, p.stdout, p.stderr)
    assert "is no longer the folder this run locked" in line, line
    assert (out / "tokenizer.json").read_text() == "theirs"
    assert json.loads((tmp_path / "m.old" / "tokenizer.json").read_text())  # (the control)
    assert sorted(os.listdir(out)) == ["tokenizer.json"]


def test_an_output_folder_whose_lock_cannot_be_written_is_not_left_behind(tmp_path):
    """With no byte writable (a file-size limit of 0; a full disk alike), the run said
    "cannot write the lock file" and left the folders it had made, an empty lock file
    in them."""
    import resource
    out = tmp_path / "new" / "u0"
    p = subprocess.run([sys.executable, str(ROOT / "cli.py"), "train", *map(str, TINY),
                        "--steps", "1", "--out", str(out)], capture_output=True, text=True,
                       timeout=600,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)))
    line = one_line_error(p.returncode, p.stdout, p.stderr)
    assert "cannot write the lock file" in line, line
    assert os.listdir(tmp_path) == []
    (tmp_path / "there").mkdir()  # the control: a folder that was there stays
    p = subprocess.run([sys.executable, str(ROOT / "cli.py"), "train", *map(str, TINY),
                        "--steps", "1", "--out", str(tmp_path / "there")], capture_output=True,
                       text=True, timeout=600,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)))
    assert "cannot write the lock file" in one_line_error(p.returncode, p.stdout, p.stderr)
    assert os.listdir(tmp_path) == ["there"]


SAVE_FAILS_AT = """
import sys
from hslm import checkpoint
from hslm.cli import main
from hslm.errors import HslmError
write, fail_at, saves = checkpoint.write_atomic_files, int(sys.argv[2]), []
def write_or_fail(files, *args, **kwargs):
    saves.extend(files[:1] if files[0][0].name.startswith("ckpt_") else [])  # (not caches)
    if len(saves) == fail_at and files[0][0].name.startswith("ckpt_"):
        raise HslmError(f"cannot write checkpoint {files[0][0]}: No space left on device")
    return write(files, *args, **kwargs)
checkpoint.write_atomic_files = write_or_fail
sys.argv = ["hslm", "train", "--model", "hslm-tiny", "--batch", "2", "--threads", "1",
            "--steps", "3", "--save-every", "1", "--out", sys.argv[1], "--quiet"]
main()
"""


def test_a_save_that_fails_mid_run_names_the_last_checkpoint_saved(tmp_path):
    """A save that failed mid-run (a full disk) said only that it could not write: which
    checkpoint is still good, the user had to find out."""
    def run(fail_at):
        p = subprocess.run([sys.executable, "-c", SAVE_FAILS_AT, str(tmp_path / f"o{fail_at}"),
                            str(fail_at)], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        return one_line_error(p.returncode, p.stdout, p.stderr)
    line = run(2)
    assert line.endswith("; step 2 not saved, the last checkpoint saved is "
                         f"{tmp_path / 'o2' / 'ckpt_1.state'}"), line
    ckpt.read(tmp_path / "o2" / "ckpt_1.state")
    assert run(1).endswith("; step 1 not saved, no checkpoint of this run is saved")


def test_info_on_a_link_loop_says_so_not_that_it_is_no_preset(tmp_path):
    """`hslm info loop` (a link to itself) said "not a preset ..., a JSON config or a
    checkpoint", where eval, sample and diff name the loop."""
    os.symlink("loop", tmp_path / "loop")
    line = one_line_error(*hslm("info", "loop", cwd=tmp_path))
    assert "symbolic links" in line and "not a preset" not in line, line
    line = one_line_error(*hslm("info", "nothing", cwd=tmp_path))  # the control: no file
    assert "not a preset" in line, line


def test_a_run_refused_for_a_busy_folder_it_found_missing_leaves_that_runs_folder(tmp_path,
                                                                                  monkeypatch):
    """Two runs on one new --out: the second judged the folder missing (its to remove on a
    failure), then met the first's lock and was refused; removing what it had made, it
    removed the first run's lock file, and the folder with it where nothing else was in
    it yet. Only empty folders are removed on a failure to take the lock."""
    from hslm import train
    from hslm.errors import HslmError
    out = tmp_path / "sweep" / "x"
    first = []
    prepare = train.prepare_out_dir

    def the_first_run_takes_it_meanwhile(folder):
        ckpt.make_folders(folder)
        first.append(FolderLock(folder).acquire())
        return prepare(folder)

    monkeypatch.setattr(train, "prepare_out_dir", the_first_run_takes_it_meanwhile)
    with pytest.raises(HslmError, match="another hslm run"):
        train.hold_out_dir(out)
    assert (out / ".hslm.lock").read_text() == f"{os.getpid()}\n"  # the first run's, held
    assert first[0].check() is None
    first[0].release()


def test_metrics_named_as_a_runs_file_is_refused_even_as_a_link_to_elsewhere(tmp_path):
    """--metrics OUT/tokenizer.json, a link to a file elsewhere: judged by its target
    alone, it was accepted, and the run replaced the link with its tokenizer.json (the
    metrics then went into that file). Either the name or its target refuses it."""
    out = tmp_path / "o"
    out.mkdir()
    elsewhere = tmp_path / "m.jsonl"
    os.symlink(elsewhere, out / "tokenizer.json")
    line = one_line_error(*hslm("train", *TINY, "--steps", 1, "--out", out, "--metrics",
                                out / "tokenizer.json"))
    assert "a name this run writes in its output folder" in line, line
    assert os.path.islink(out / "tokenizer.json") and not elsewhere.exists()
    os.symlink(elsewhere, out / "metrics.jsonl")  # (the control: a name of its own)
    code, _, err = hslm("train", *TINY, "--steps", 1, "--out", out, "--metrics",
                        out / "metrics.jsonl")
    assert code == 0 and '"kind": "train"' in elsewhere.read_text(), err


def test_a_lock_file_removed_by_its_holder_while_this_run_took_it_is_refused(tmp_path,
                                                                              monkeypatch):
    """A run whose pid cannot be written removes its lock file (it holds the flock then);
    another run that had opened that file meanwhile then locked a file no longer at the
    name (trained, and was refused at its first save, while a third run could take the
    folder). The file locked must be the one at the name."""
    import fcntl
    from hslm.errors import HslmError
    flock = fcntl.flock

    def holder_removes_it_meanwhile(fd, op):
        os.unlink(tmp_path / ".hslm.lock")
        return flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", holder_removes_it_meanwhile)
    with pytest.raises(HslmError, match="its lock file was replaced"):
        FolderLock(tmp_path).acquire()
    monkeypatch.setattr(fcntl, "flock", flock)
    FolderLock(tmp_path).acquire().release()  # (the control)
