import click
from click.testing import CliRunner


@click.command()
def cli():
    raise click.Abort()


def test_cancelled_message():
    result = CliRunner(mix_stderr=True).invoke(cli, [])
    assert result.exit_code == 1
    assert "Cancelled." in result.output
    assert "Aborted!" not in result.output
