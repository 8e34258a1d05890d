"""Tokenizer, corpus and split."""
import numpy as np

from hslm.rng import Stream
import pytest
from hypothesis import given, settings, strategies as st

from hslm.data import FIRST_MERGE, Corpus, Tokenizer, builtin_text


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(builtin_text(), 729)


def test_builtin_tokenizer_has_all_merges_and_is_deterministic(tok):
    assert len(tok.merges) == 729 - FIRST_MERGE == 469
    again = Tokenizer.train(builtin_text(), 729)
    assert np.array_equal(tok.merges, again.merges) and tok.identity == again.identity
    assert Tokenizer.from_json(tok.to_json()).identity == tok.identity


def test_ties_go_to_the_smaller_pair():
    t = Tokenizer.train("ab" + "cd" + "ab" + "cd", 261)  # ab and cd both occur twice
    assert tuple(t.merges[0]) == (ord("a") + 4, ord("b") + 4)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip_any_unicode(tok, s):
    ids = tok.encode(s)
    assert ids.dtype == np.int64 and (ids < 729).all() and (ids >= 4).all()
    assert tok.decode(ids) == s


def test_split_and_windows():
    c = Corpus.load(None, 729, 27)
    n = len(c.tokens)
    assert len(c.valid) == int(n * 0.1) and len(c.train) + len(c.valid) == n
    assert np.array_equal(np.concatenate([c.train, c.valid]), c.tokens)
    assert c.tokenizer.decode(c.tokens) == builtin_text()
    rng = Stream.seeded("test", 0)
    w = c.draw_windows(rng, 64, 27)
    assert w.shape == (64, 28) and w.max() < 729
    v = c.validation_windows(64, 27)
    assert v.shape == (64, 28)
