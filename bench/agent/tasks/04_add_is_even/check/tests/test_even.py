from mathutils import clamp, is_even


def test_is_even():
    assert is_even(4) is True
    assert is_even(7) is False
    assert is_even(0) is True
    assert clamp(5, 0, 3) == 3
