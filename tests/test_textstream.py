"""Rank 0's text of a request: deltas, stop strings, and the once-at-the-end
decode, on the built-in model's real byte-level tokenizer."""

from __future__ import annotations

import random

import pytest

from ringserve.engine.textstream import TextStream
from ringserve.models.builtin import builtin_model_dir
from ringserve.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(builtin_model_dir())


def test_deltas_and_the_deferred_decode_give_the_same_text(tok):
    rng = random.Random(3)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        live, deferred = TextStream(tok), TextStream(tok, incremental=False)
        deltas = [live.push(t) for t in ids]
        assert all(deferred.push(t) == "" for t in ids)
        deltas.append(live.finish())
        deferred.finish()
        assert "".join(deltas) == live.text == deferred.text == tok.decode(ids)


def test_text_stops_before_the_first_stop_string_even_across_tokens(tok):
    ids = tok.encode("the river runs to the sea and on", add_special_tokens=False)
    stream = TextStream(tok, stop=("to the s",))
    released = "".join(stream.push(t) for t in ids) + stream.finish()
    assert stream.stopped and released == stream.text == "the river runs "


def test_the_stop_string_that_ends_the_text_is_the_earliest_there(tok):
    ids = tok.encode("the river runs to the sea", add_special_tokens=False)
    for stops, hit in [(("sea", "runs"), "runs"), (("river", "riv"), "river"), (("x",), None)]:
        stream = TextStream(tok, stop=stops)
        "".join(stream.push(t) for t in ids) + stream.finish()
        assert stream.stop_string == hit, stops


def test_text_that_might_begin_a_stop_string_is_held_back(tok):
    stream = TextStream(tok, stop=("END",))
    ids = tok.encode("abc EN", add_special_tokens=False)
    released = "".join(stream.push(t) for t in ids)
    assert not released.endswith("EN") and not stream.stopped
    assert released + stream.finish() == "abc EN"
