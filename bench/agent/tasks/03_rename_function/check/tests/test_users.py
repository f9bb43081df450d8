from app import greeting
from users import get_user


def test_get_user():
    assert get_user(1) == "ada"


def test_greeting():
    assert greeting(2) == "Hello, grace!"
