from stats import safe_max


def test_safe_max():
    assert safe_max([1, 5, 2]) == 5
    assert safe_max([]) is None
