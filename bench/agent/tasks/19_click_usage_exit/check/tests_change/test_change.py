import click
from click.testing import CliRunner


@click.command()
@click.argument("name")
def cli(name):
    click.echo(name)


def test_unknown_option_exits_64():
    assert CliRunner().invoke(cli, ["--nope", "x"]).exit_code == 64


def test_missing_argument_exits_64():
    assert CliRunner().invoke(cli, []).exit_code == 64


def test_success_still_zero():
    assert CliRunner().invoke(cli, ["x"]).exit_code == 0
