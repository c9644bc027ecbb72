"""TextTracker decodes incrementally yet shows exactly what decoding every token on every step would show."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from inkwell.models.tokenizer import SPECIAL_TOKENS, build_tokenizer
from inkwell.serving.text import REPLACEMENT, TextTracker

PIECES = ["a", "b", " ", "caf\u00e9", "\u4e2d\u6587", "\U0001f600", "\n"]  # 1- to 4-byte characters


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def random_ids(tokenizer, rng: random.Random, length: int) -> list[int]:
    """Byte tokens of random text (multi-byte characters split over tokens), with special tokens and stray
    continuation bytes (never completed: they decode to U+FFFD) mixed in."""
    ids: list[int] = []
    specials = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)
    while len(ids) < length:
        roll = rng.random()
        if roll < 0.05:
            ids.append(rng.choice(specials))
        elif roll < 0.08:
            ids += tokenizer.encode("\u00e9", add_special_tokens=False)[1:]  # a lone continuation byte
        else:
            ids += tokenizer.encode(rng.choice(PIECES), add_special_tokens=False)
    return ids[:length]  # may end inside a character


@pytest.mark.parametrize("seed", range(20))
def test_every_step_shows_the_full_decode_less_a_partial_character(tokenizer, seed):
    rng = random.Random(seed)
    ids = random_ids(tokenizer, rng, rng.randint(1, 120))
    tracker, shown = TextTracker(tokenizer, ()), ""
    for i in range(1, len(ids) + 1):
        final = i == len(ids)
        delta, stopped = tracker.update(ids[:i], final)
        shown += delta
        full = tokenizer.decode(ids[:i], skip_special_tokens=True)
        assert not stopped
        assert shown == (full if final else full.rstrip(REPLACEMENT)), f"step {i} of {ids}"


@pytest.mark.parametrize("seed", range(10))
def test_a_stop_string_ends_the_text_where_it_starts(tokenizer, seed):
    rng = random.Random(seed)
    before = tokenizer.decode(random_ids(tokenizer, rng, rng.randint(0, 60)), skip_special_tokens=True)
    before = before.replace("\u6587\U0001f600", "")  # the stop string below must first appear where placed
    ids = tokenizer.encode(before + "\u6587\U0001f600 tail", add_special_tokens=False)
    tracker, shown = TextTracker(tokenizer, ("\u6587\U0001f600",)), ""
    for i in range(1, len(ids) + 1):
        delta, stopped = tracker.update(ids[:i], final=False)
        shown += delta
        assert "\u6587" not in shown[len(before) :]
        if stopped:
            break
    assert stopped and shown == before


def test_a_final_update_that_repeats_the_tokens_releases_the_held_tail(tokenizer):
    """The engine's last update drops a stop token, so it passes the same tokens again with final=True."""
    ids = tokenizer.encode("ok \u00e9", add_special_tokens=False)[:-1]  # ends inside the "é"
    tracker = TextTracker(tokenizer, ())
    assert tracker.update(ids, final=False) == ("ok ", False)
    assert tracker.update(ids, final=True) == (REPLACEMENT, False)


def test_a_decoder_that_strips_a_leading_space_keeps_the_spaces_between_words():
    """SentencePiece-style decoders drop the space before a decoded text's first word; a tail decoded alone
    would lose the space between words, so each tail is decoded after its context chunk."""
    vocab = {"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "!": 3, "\u2581again": 4}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer, core.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    ids = [1, 2, 3, 4]
    tracker, shown = TextTracker(tokenizer, ()), ""
    for i in range(1, len(ids) + 1):
        shown += tracker.update(ids[:i], final=i == len(ids))[0]
    assert shown == tokenizer.decode(ids) == "Hello world! again"
