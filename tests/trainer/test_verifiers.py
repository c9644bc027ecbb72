"""The built-in verifiers: rewards in [0, 1] from a completion and the dataset's answer, chosen by name."""

import pytest

from inkwell.trainer.verifiers import VERIFIERS, exact_match, regex, verifier


def test_exact_match_ignores_surrounding_whitespace_only():
    assert exact_match(" Paris\n", "Paris") == 1.0
    assert exact_match("paris", "Paris") == 0.0
    assert exact_match("Paris!", "Paris") == 0.0


def test_regex_matches_the_whole_completion():
    assert regex(" 7", "[13579]") == 1.0
    assert regex("74", "[13579]") == 0.0  # the whole completion, not a prefix
    assert regex("4", "[13579]") == 0.0


def test_verifiers_are_chosen_by_name():
    assert {name: verifier(name) for name in VERIFIERS} == VERIFIERS
    with pytest.raises(ValueError, match="unknown verifier 'fuzzy'; built in: exact_match, regex"):
        verifier("fuzzy")
