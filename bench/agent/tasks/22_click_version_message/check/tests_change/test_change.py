import click
from click.testing import CliRunner


@click.command()
@click.version_option("1.2.3", prog_name="tool")
def cli():
    pass


def test_version_message():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == "tool v1.2.3"
