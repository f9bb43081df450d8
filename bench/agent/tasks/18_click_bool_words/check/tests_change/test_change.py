import click


def test_enabled_disabled():
    assert click.BOOL.convert("enabled", None, None) is True
    assert click.BOOL.convert("Disabled", None, None) is False


def test_old_words_still_work():
    assert click.BOOL.convert("yes", None, None) is True
    assert click.BOOL.convert("off", None, None) is False
