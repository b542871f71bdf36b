import sys

sys.path.insert(0, "/app")

from wordcount import count_words  # noqa: E402


def test_tabs():
    assert count_words("one\ttwo three") == 3


def test_runs_and_line_breaks():
    assert count_words("one   two\nthree four") == 4


def test_no_words():
    assert count_words("") == 0
    assert count_words("   \n ") == 0
