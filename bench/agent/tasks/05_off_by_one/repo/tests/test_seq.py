from seq import last_n


def test_last_two():
    assert last_n([1, 2, 3, 4], 2) == [3, 4]


def test_more_than_available():
    assert last_n([1], 3) == [1]


def test_zero():
    assert last_n([1, 2], 0) == []
