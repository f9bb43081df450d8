from textstats import count_words


def test_count_words():
    assert count_words("the quick  brown\tfox\n") == 4
    assert count_words("") == 0
