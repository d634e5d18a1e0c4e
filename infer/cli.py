"""`ntransformer`: the inference command line (placeholder until the engine lands)."""

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-m", "--model", type=click.Path(), help="GGUF model file.")
def main(model: str | None) -> None:
    """Run a GGUF model (not implemented yet)."""
    raise click.ClickException("inference is not implemented in this version")
