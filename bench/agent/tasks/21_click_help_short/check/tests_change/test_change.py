import click
from click.testing import CliRunner


@click.command()
def cli():
    """Say hi."""
    click.echo("hi")


def test_dash_h_shows_help():
    result = CliRunner().invoke(cli, ["-h"])
    assert result.exit_code == 0
    assert "Usage:" in result.output


def test_long_help_still_works():
    assert "Usage:" in CliRunner().invoke(cli, ["--help"]).output
