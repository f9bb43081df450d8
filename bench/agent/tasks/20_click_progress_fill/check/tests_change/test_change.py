import click


def test_default_fill_is_equals():
    with click.progressbar(range(3)) as bar:
        assert bar.fill_char == "="
