from text import reverse_words


def test_reverse_words():
    assert reverse_words("hello big world") == "world big hello"
    assert reverse_words("one") == "one"
