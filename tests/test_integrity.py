"""Issue 11: a file is believed only when all of it checks out.

The fuzz tests mutate a real .bin and .state (bit flips, truncations, structured
header mutations with and without recomputed checksums) and require each result
to be refused with an HslmError or to load to exactly the original numbers."""
import hashlib
import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hslm import checkpoint as ckpt
from hslm.config import PRESETS
from hslm.data import Corpus, Tokenizer
from hslm.errors import HslmError
from hslm.step import StepRunner
from hslm.train import Hyper, Run

TEXT = "".join(f"line {i}: the quick brown fox {i % 7} jumps over {i % 13} lazy dogs.\n"
               for i in range(400))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(bin bytes, state bytes, the Run that wrote them) after one step of hslm-tiny."""
    cfg = PRESETS["hslm-tiny"]
    corpus = Corpus(TEXT, cfg.vocab, cfg.window, "test text")
    run = Run.fresh(cfg, Hyper(batch=2, loss_positions=cfg.window, seed=3), corpus)
    runner = StepRunner(cfg, 3, 1)
    run.train_step(runner)
    runner.close()
    d = tmp_path_factory.mktemp("ck")
    b, s = run.save(d)
    return b.read_bytes(), s.read_bytes(), run


def test_the_profiles_timed_products_change_no_bit_and_count_cycles():
    """hslm bench's profile runs speed 3 with a clock of CLOCK_SLOTS (Model.clock: each
    matrix product's cycles, the weight gradients' W_up and W_down and dense operands',
    and the forward's and backward's attention, norms and loss): the same step bytes as
    with the clock of 2 every run has, and cycles counted only there, in every slot (the
    control: the step's bytes do change from the start's)."""
    from hslm.layers import CLOCK_SLOTS
    cfg = PRESETS["hslm-tiny"]
    corpus = Corpus(TEXT, cfg.vocab, cfg.window, "test text")
    out = []
    for timed in (False, True):
        run = Run.fresh(cfg, Hyper(batch=2, loss_positions=cfg.window, seed=3), corpus)
        start = run.state.theta.tobytes()
        runner = StepRunner(cfg, 3, 1)
        if timed:
            run.state.clock = np.zeros(CLOCK_SLOTS)
        try:
            run.train_step(runner)
        finally:
            runner.close()
        out.append((run.state.theta.tobytes() + run.m.tobytes() + run.v.tobytes(),
                    run.state.clock.copy()))
    assert out[0][0] == out[1][0]
    assert out[0][0][:len(start)] != start  # (the step moved theta: a comparison that can fail)
    assert (out[0][1] == 0.0).all() and len(out[0][1]) == 2, out[0][1]
    from hslm.bench import cycles_per_second
    if cycles_per_second():  # (0 on a machine with no cycle counter: no split, nothing counted)
        assert (out[1][1] > 0.0).all(), out[1][1]


def split(raw):
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def assemble(header, data, recompute=True, header_json=None):
    """A file from a header dict; with recompute, a fresh header_sha256 (a hostile
    hand-made file passes the integrity check and must be caught by structure checks)."""
    if recompute and isinstance(header.get("__metadata__"), dict):
        meta = {k: v for k, v in header["__metadata__"].items() if k != "header_sha256"}
        rest = dict(header, __metadata__=meta)
        meta = dict(meta, header_sha256=hashlib.sha256(
            json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest())
        header = dict(header, __metadata__=meta)
    h = header_json if header_json is not None else json.dumps(
        header, sort_keys=True, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def outcome(raw, original):
    """'refused', or 'same' when the file loads to exactly the original numbers (every
    tensor, same names, shapes and bits); anything else (another exception, other
    numbers, another layout) fails the test. The metadata may differ only in a file
    whose checksums were recomputed, and then it has passed every check: a
    consistent file that says something else (another vsa_dim, say), not damage."""
    try:
        ck = ckpt.parse(raw, "mutant")
    except HslmError as e:
        assert "\n" not in str(e)
        return "refused"
    ref = ckpt.parse(original, "original")
    assert ck.kind == ref.kind and ck.names() == ref.names()
    assert ck.flat().view(np.uint64).tobytes() == ref.flat().view(np.uint64).tobytes()
    for name in ref.names():
        assert ck.tensor(name).shape == ref.tensor(name).shape
        assert np.array_equal(ck.tensor(name).view(np.uint64), ref.tensor(name).view(np.uint64))
    assert ck.config.n_params == ref.config.n_params
    if ck.kind == "params":
        assert ck.tokenizer().vocab == ck.config.vocab
    else:
        assert 1 <= ck.hyper.loss_positions <= ck.config.window
    return "same" if ck.meta == ref.meta else "consistent"


FAST = settings(max_examples=1500, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])


@FAST
@given(which=st.sampled_from([0, 1]), pos=st.floats(0, 1, exclude_max=True),
       bit=st.integers(0, 7), in_header=st.booleans())
def test_any_single_bit_flip_is_refused(files, which, pos, bit, in_header):
    raw = files[which]
    (n,) = struct.unpack("<Q", raw[:8])
    # half the flips land in the length or header, half anywhere
    i = int(pos * (8 + n)) if in_header else int(pos * len(raw))
    mutant = bytearray(raw)
    mutant[i] ^= 1 << bit
    with pytest.raises(HslmError, match="damaged|not a valid|format 1"):
        ckpt.parse(bytes(mutant), "mutant")


@settings(FAST, max_examples=400)
@given(which=st.sampled_from([0, 1]), cut=st.floats(0, 1, exclude_max=True),
       extra=st.binary(max_size=16))
def test_truncations_and_appended_bytes_are_refused(files, which, cut, extra):
    raw = files[which]
    mutant = raw[:int(cut * len(raw))] if not extra else raw + extra
    with pytest.raises(HslmError):
        ckpt.parse(mutant, "mutant")


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=6)


@st.composite
def mutation(draw, header):
    """A structured mutation of a parsed header: (new header, header bytes or None)."""
    h = json.loads(json.dumps(header))
    meta = h["__metadata__"]
    names = [k for k in h if k != "__metadata__"]
    kind = draw(st.sampled_from(["meta_value", "meta_json_field", "meta_delete", "meta_add",
                                 "meta_type", "tensor_field", "offsets", "shape", "rename",
                                 "drop_tensor", "add_tensor", "deep", "noop"]))
    if kind == "meta_value":
        k = draw(st.sampled_from(sorted(meta)))
        v = meta[k]
        if v and draw(st.booleans()):
            i = draw(st.integers(0, len(v) - 1))
            v = v[:i] + draw(st.characters(codec="ascii")) + v[i + 1:]
        else:
            v = draw(st.text(max_size=20))
        meta[k] = v
    elif kind == "meta_json_field":
        k = draw(st.sampled_from([k for k in ("config", "hyper", "rng", "tokenizer")
                                  if meta.get(k, "").startswith("{")]))
        obj = json.loads(meta[k])
        keys = sorted(obj)
        f = draw(st.sampled_from(keys))
        choice = draw(st.sampled_from(["value", "delete", "int", "nudge"]))
        if choice == "delete":
            del obj[f]
        elif choice == "int":
            obj[f] = draw(st.integers(-3, 10 ** 12))
        elif choice == "nudge" and isinstance(obj[f], (int, float)) and not isinstance(
                obj[f], bool):
            obj[f] = obj[f] + draw(st.sampled_from([-1, 1, 2, 0.5]))
        else:
            obj[f] = draw(JSONISH)
        meta[k] = json.dumps(obj, sort_keys=draw(st.booleans()), separators=(",", ":"))
    elif kind == "meta_delete":
        del meta[draw(st.sampled_from(sorted(meta)))]
    elif kind == "meta_add":
        meta[draw(st.text(min_size=1, max_size=8))] = draw(st.text(max_size=8))
    elif kind == "meta_type":
        if draw(st.booleans()):
            h["__metadata__"] = draw(JSONISH)
        else:
            meta[draw(st.sampled_from(sorted(meta)))] = draw(JSONISH)
    elif kind == "tensor_field":
        t = draw(st.sampled_from(names))
        f = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
        h[t][f] = draw(JSONISH | st.sampled_from(["F32", "I64", "F64"]))
    elif kind == "offsets":
        t = draw(st.sampled_from(names))
        a, b = h[t]["data_offsets"]
        how = draw(st.sampled_from(["swap", "shift", "overlap"]))
        if how == "swap" and len(names) > 1:
            u = draw(st.sampled_from([n for n in names if n != t]))
            h[t]["data_offsets"], h[u]["data_offsets"] = h[u]["data_offsets"], h[t]["data_offsets"]
            if draw(st.booleans()):
                h[t]["shape"], h[u]["shape"] = h[u]["shape"], h[t]["shape"]
        elif how == "shift":
            s = draw(st.sampled_from([-8, 8, -16, 16]))
            h[t]["data_offsets"] = [a + s, b + s]
        else:
            h[t]["data_offsets"] = [max(0, a - 8), b]
    elif kind == "shape":
        t = draw(st.sampled_from(names))
        shape = h[t]["shape"]
        how = draw(st.sampled_from(["transpose", "flatten", "change"]))
        if how == "transpose":
            h[t]["shape"] = shape[::-1]
        elif how == "flatten":
            h[t]["shape"] = [int(np.prod(shape))]
        else:
            h[t]["shape"] = [draw(st.integers(0, 10 ** 6)) for _ in shape]
    elif kind == "rename":
        t = draw(st.sampled_from(names))
        new = draw(st.text(min_size=1, max_size=12) | st.sampled_from(names))
        h[new] = h.pop(t)
    elif kind == "drop_tensor":
        del h[draw(st.sampled_from(names))]
    elif kind == "add_tensor":
        h[draw(st.text(min_size=1, max_size=8))] = {"dtype": "F64", "shape": [0],
                                                    "data_offsets": [0, 0]}
    elif kind == "deep":
        depth = draw(st.sampled_from([50, 5000, 100000]))
        deep = "[" * depth + "]" * depth
        if draw(st.booleans()):  # inside a metadata JSON string
            meta[draw(st.sampled_from(sorted(meta)))] = deep
        else:  # in the header itself
            enc = json.dumps(h, sort_keys=True, separators=(",", ":")).encode()
            return h, enc[:-1] + b',"zz":' + deep.encode() + b"}"
    return h, None


@settings(FAST, max_examples=1500)
@given(data=st.data(), which=st.sampled_from([0, 1]), recompute=st.booleans())
def test_structured_header_mutations_are_refused_or_harmless(files, data, which, recompute):
    raw = files[which]
    header, body = split(raw)
    h, enc = data.draw(mutation(header))
    result = outcome(assemble(h, body, recompute, enc), raw)
    if not recompute:  # without new checksums, a real change is always refused
        assert result == "refused" or (result == "same" and h == header and enc is None)


def test_the_files_are_canonical_and_the_original_loads(files):
    for raw in files[:2]:
        header, body = split(raw)
        assert assemble(header, body, recompute=True) == raw
        assert outcome(raw, raw) == "same"


def hand_made(raw, edit):
    """The file with edit(header) applied and checksums recomputed: a foreign file."""
    header, body = split(raw)
    edit(header)
    return assemble(header, body)


def set_json(header, key, **fields):
    obj = json.loads(header["__metadata__"][key])
    obj.update(fields)
    header["__metadata__"][key] = json.dumps(obj, sort_keys=True, separators=(",", ":"))


@pytest.mark.parametrize("edit,expect", [
    (lambda h: h["__metadata__"].update(config=PRESETS["hslm-3"].to_json()), "implies"),
    (lambda h: h["__metadata__"].update(config="{}"), "config"),
    (lambda h: set_json(h, "config", blocks=1_000_000), "at most 1,024"),
    (lambda h: set_json(h, "config", vocab=10 ** 9), "at most 1,048,576"),
    (lambda h: h["__metadata__"].pop("data_sha256"), "missing data_sha256"),
    (lambda h: h["__metadata__"].pop("kind"), "kind"),
    (lambda h: h.update(__metadata__="x"), "damaged"),
    (lambda h: h.update(Wnew=h.pop("Wout")), "tensor names"),
    (lambda h: h["E"].update(shape=h["E"]["shape"][::-1]), "tensor E"),
])
def test_hand_made_bin_headers_are_refused(files, edit, expect):
    with pytest.raises(HslmError, match=expect):
        ckpt.parse(hand_made(files[0], edit), "x.bin")


@pytest.mark.parametrize("field,value", [
    ("loss_positions", 99), ("loss_positions", 0), ("lr", float("inf")), ("lr", -1.0),
    ("weight_decay", -0.5), ("seed", -1), ("batch", 0), ("batch", True), ("lr", 1),
    ("weight_decay", 1000.0),
])
def test_hand_made_state_hyper_is_checked_like_the_flags(files, field, value):
    raw = hand_made(files[1], lambda h: set_json(h, "hyper", **{field: value}))
    with pytest.raises(HslmError, match="not a valid"):
        ckpt.parse(raw, "x.state")


def test_weight_decay_is_bounded_by_lr_times_decay_below_one():
    """Each step scales the decayed weights by 1 - lr x weight decay: refused at 1 and
    above, where the weights would be wiped or flip sign every step; just below, kept."""
    from hslm.validate import hyper_problems
    cfg = PRESETS["hslm-tiny"]

    def fields(**kw):
        return [f for f, _ in hyper_problems(cfg, Hyper(loss_positions=cfg.window, **kw))]
    assert fields(lr=1e-3, weight_decay=999.0) == []
    assert fields(lr=1e-3, weight_decay=1000.0) == ["weight_decay"]
    assert fields(lr=0.5, weight_decay=1.999) == []
    assert fields(lr=0.5, weight_decay=2.0) == ["weight_decay"]


@pytest.mark.parametrize("rng", [
    "{}", '{"bit_generator":"MT19937","has_uint32":0,"state":{"inc":1,"state":1},"uinteger":0}',
    '{"bit_generator":"PCG64","has_uint32":0,"state":{"inc":2,"state":1},"uinteger":0}',
    '{"bit_generator":"PCG64","has_uint32":0,"state":{"inc":1,"state":-1},"uinteger":0}',
    '{"bit_generator":"PCG64","has_uint32":2,"state":{"inc":1,"state":1},"uinteger":0}',
    "[" * 10000 + "]" * 10000, "not json",
])
def test_hand_made_rng_state_is_checked(files, rng):
    raw = hand_made(files[1], lambda h: h["__metadata__"].update(rng=rng))
    with pytest.raises(HslmError, match="not a valid"):
        ckpt.parse(raw, "x.state")


def test_a_format_1_file_is_refused_by_name(files):
    def v1(h):
        h["__metadata__"]["format_version"] = "1"
    header, body = split(files[0])
    v1(header)
    del header["__metadata__"]["header_sha256"]
    with pytest.raises(HslmError, match="format 1"):
        ckpt.parse(assemble(header, body, recompute=False), "old.bin")


def test_non_finite_checkpoint_is_named(files, tmp_path):
    run = files[2]
    theta = run.state.theta.copy()
    theta[5] = np.nan
    raw = b"".join(ckpt.params_parts(run.cfg, theta, 1, run.corpus.tokenizer))
    ck = ckpt.parse(raw, "nan.bin")
    with pytest.raises(HslmError, match="non-finite.*of E"):
        ck.check_finite()


@pytest.mark.parametrize("merges", [[[4, 999]], [[3, 5]], [[4, 5], [261, 4]], [[4]], "x",
                                    [[4.0, 5]], [[101, 102], [5, 6], [101, 102]]])
def test_tokenizer_json_with_bad_merges_is_refused(merges):
    with pytest.raises(HslmError, match="tokenizer is not valid"):
        Tokenizer.from_json(json.dumps({"format": "hslm-bpe", "version": 1, "vocab": 300,
                                        "merges": merges}))
    with pytest.raises(HslmError, match="tokenizer is not valid"):
        Tokenizer.from_json("[" * 100000)


def test_a_tokenizer_that_merges_a_pair_twice_is_refused():
    """Learning never merges a pair twice (its two ids never meet again), and the two
    encoders took different merges of such a tokenizer (the kernel the first, a short
    prompt's ranks the last: "abab" 260 260 or 261 261 by the vocabulary's size). Control:
    the same pairs once each, and a pair with its reverse, are a tokenizer."""
    def tokenizer(merges, vocab=300):
        return Tokenizer.from_json(json.dumps({"format": "hslm-bpe", "version": 1,
                                               "vocab": vocab, "merges": merges}))
    for vocab in (300, 2000):
        with pytest.raises(HslmError, match=r"merge 2 repeats merge 0's pair \[101, 102\]"):
            tokenizer([[101, 102], [5, 6], [101, 102]], vocab)
        ok = tokenizer([[101, 102], [102, 101]], vocab)
        assert ok.encode("abab").tolist() == [260, 260]


def test_the_bin_carries_its_tokenizer(files):
    ck = ckpt.parse(files[0], "x.bin")
    assert ck.tokenizer().identity == files[2].corpus.tokenizer.identity
    st_ = ckpt.parse(files[1], "x.state")
    assert st_.meta["tokenizer"] == ck.tokenizer().identity


def test_a_step_of_thousands_of_digits_is_refused_not_a_traceback(files):
    """int() of a string over 4,300 digits raises ValueError (Python 3.11+): the length
    is judged first. With valid checksums, as anyone can make them."""
    for step in ("1" * 5000, "1" * 19, "0" * 5000):
        raw = hand_made(files[1], lambda h: h["__metadata__"].update(step=step))
        with pytest.raises(HslmError, match="is not a non-negative integer"):
            ckpt.parse(raw, "x.state")
    raw = hand_made(files[1], lambda h: h["__metadata__"].update(step="1" * 18))
    assert ckpt.parse(raw, "x.state").step == int("1" * 18)  # (control: 18 digits are a step)


def test_a_header_nested_at_any_depth_is_refused_not_a_traceback(files):
    """Nested just within what json.loads reads, a header could not be encoded again (the
    encoder's frames are deeper): a RecursionError from the canonical-form check."""
    import sys
    _, body = split(files[0])
    limit = sys.getrecursionlimit()
    hazard = 0  # control: depths that parse but cannot be encoded, so the sweep reaches them
    for depth in range(1, limit + 50):
        h = b'{"__metadata__":{},"x":' + b"[" * depth + b"]" * depth + b"}"
        try:
            parsed = json.loads(h)
        except RecursionError:
            continue
        try:
            ckpt._canonical(parsed)
        except RecursionError:
            hazard += 1
        raw = struct.pack("<Q", len(h) + (-len(h) % 8)) + h + b" " * (-len(h) % 8) + body
        with pytest.raises(HslmError, match="damaged|nested too deeply"):
            ckpt.parse(raw, "x.bin")
    assert hazard > 0
    h = b'{"__metadata__":{},"x":' + b"[" * 65 + b"]" * 65 + b"}"
    with pytest.raises(HslmError, match="nested too deeply"):
        ckpt.parse(struct.pack("<Q", len(h)) + h + body, "x.bin")


def test_diff_of_all_nan_tensors_and_of_deep_fields_is_plain(files, tmp_path):
    """hslm diff: a tensor whose differing elements are all NaN printed numpy's
    RuntimeWarning (with its source line); a metadata field nested past json's depth (a
    data_source of 60,000 '[') stopped it with a RecursionError."""
    import warnings

    from hslm.inspect import _json_dict, diff_checkpoints
    run = files[2]
    paths = []
    for i, value in enumerate((np.nan, -np.nan)):
        theta = run.state.theta.copy()
        theta[5] = value  # (two NaNs of other bits: the element differs, |diff| is NaN)
        paths.append(tmp_path / f"nan{i}.bin")
        paths[-1].write_bytes(b"".join(ckpt.params_parts(run.cfg, theta, 1, run.corpus.tokenizer)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same, lines = diff_checkpoints(*paths)
    assert not same and any("1 of" in line and "max |diff| nan" in line for line in lines)
    assert _json_dict("[" * 60000) is None and _json_dict('{"a": 1}') == {"a": 1}


def test_saving_resuming_and_reading_a_state_hold_no_second_copy(files, tmp_path,
                                                                 monkeypatch):
    """A save writes each tensor from where it lies, a resume keeps the arrays it read,
    and a .state read for its header alone (eval, sample) is hashed a piece at a time:
    none holds another copy of the model in memory. A save had built both files whole
    (about 7 copies of the parameters beside the run: a model that trained within memory
    was killed by its first save) and a resume had read both files whole, then copied
    them. Measured with tracemalloc (numpy's arrays are traced) as the peak above what
    is held after, against one copy of the parameters; the control shows that the
    measure sees a copy of the files made in one piece."""
    import tracemalloc
    run = files[2]
    one_copy = 8 * run.cfg.n_params
    monkeypatch.setattr(ckpt, "READ_CHUNK", 4096)  # (pieces as small against this model)

    def transient(work):
        tracemalloc.reset_peak()
        result = work()
        current, peak = tracemalloc.get_traced_memory()
        return result, peak - current

    tracemalloc.start()
    try:
        (b, s), saving = transient(lambda: run.save(tmp_path))
        whole, joined = transient(lambda: len(b"".join(
            ckpt.params_parts(run.cfg, run.state.theta, run.step, run.corpus.tokenizer))))
        resumed, resuming = transient(lambda: Run.resume(
            s, lambda cfg, hyper, text_sha256, tok, step: run.corpus))
        header_only, reading = transient(lambda: ckpt.read(s, "state", keep_data=False))
    finally:
        tracemalloc.stop()
    assert joined >= one_copy, (joined, one_copy)  # control: a copy is seen
    assert saving < one_copy / 4, (saving, one_copy)
    assert resuming < one_copy / 4, (resuming, one_copy)
    assert reading < one_copy / 4, (reading, one_copy)
    assert b.read_bytes() == files[0] and s.read_bytes() == files[1]  # the same bytes
    assert resumed.state.theta.tobytes() == run.state.theta.tobytes()
    assert resumed.m.tobytes() == run.m.tobytes() and resumed.v.tobytes() == run.v.tobytes()
    assert header_only.hyper == run.hyper and header_only.data is None


def test_a_checkpoint_that_changes_while_read_is_refused(files, tmp_path, monkeypatch):
    """read() takes the file's size once: a file cut short or grown while it is read is
    damage, said in one line (not believed, not a traceback)."""
    path = tmp_path / "x.bin"
    path.write_bytes(files[0])
    real = ckpt.open_regular
    for change, why in ((lambda: path.write_bytes(files[0][:-100]), "ended after"),
                        (lambda: path.write_bytes(files[0] + b"\0"), "grew while")):
        def opened(p, what, limit=None, change=change):
            f, size = real(p, what, limit)
            change()  # (the same inode, rewritten in place)
            return f, size
        monkeypatch.setattr(ckpt, "open_regular", opened)
        with pytest.raises(HslmError, match=why):
            ckpt.read(path)
        path.write_bytes(files[0])
    monkeypatch.setattr(ckpt, "open_regular", real)
    assert ckpt.read(path).same_bytes(ckpt.parse(files[0], "x.bin"))  # (control)


def test_a_huge_state_read_for_its_header_is_refused_before_it_is_hashed(files, tmp_path):
    """eval and sample read the .state beside a .bin for its hyper-parameters, hashing its
    data a piece at a time: a hand-made one whose header is whole (its checksum
    recomputed) but describes a terabyte (a sparse file) is refused from its header,
    at once, not hashed for an hour; so is a well-formed one of another model."""
    import time
    from hslm.config import canonical_json
    size = 1 << 40
    header = {"adam.m": {"dtype": "F64", "shape": [size // 8], "data_offsets": [0, size]}}
    header["__metadata__"] = {"format": "hslm", "format_version": "2", "kind": "state",
                              "data_sha256": "0" * 64}
    header["__metadata__"]["header_sha256"] = hashlib.sha256(
        canonical_json(header).encode()).hexdigest()
    h = canonical_json(header).encode()
    h += b" " * (-len(h) % 8)
    path = tmp_path / "huge.state"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        f.truncate(8 + len(h) + size)
    start = time.monotonic()
    with pytest.raises(HslmError, match="not a valid hslm checkpoint"):
        ckpt.read(path, "state", keep_data=False)
    assert time.monotonic() - start < 5
    state = tmp_path / "x.state"
    state.write_bytes(files[1])
    other = PRESETS["hslm-test"] if files[2].cfg != PRESETS["hslm-test"] else PRESETS["hslm-3"]
    with pytest.raises(HslmError, match="of another model"):
        ckpt.read(state, "state", keep_data=False, expect_config=other)
    ck = ckpt.read(state, "state", keep_data=False, expect_config=files[2].cfg)  # (control)
    assert ck.hyper == files[2].hyper and ck.same_bytes(ckpt.parse(files[1], "x.state"))
