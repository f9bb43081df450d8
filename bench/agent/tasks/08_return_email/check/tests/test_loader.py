from loader import load_user


def test_email_kept():
    user = load_user('{"id": 1, "name": "ada", "email": "ada@example.com", "password": "x"}')
    assert user == {"id": 1, "name": "ada", "email": "ada@example.com"}
