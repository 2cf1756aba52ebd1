"""`python -m sits_api.cli` is `sitsctl`."""

from sits_api.cli.main import cli

cli()
