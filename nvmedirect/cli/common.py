"""What every `nvmedirect` subcommand shares: exit codes, the -o/--json option, printers."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2  # also click's own code for usage errors
EXIT_REFUSED = 3  # a safety refusal: nothing was changed
EXIT_NOT_READY = 4  # `check` found a prerequisite missing


class Refused(click.ClickException):
    """A safety refusal: the message says why; nothing was changed."""

    exit_code = EXIT_REFUSED

    def format_message(self) -> str:
        return f"refused: {self.message}"


class BadInput(click.ClickException):
    exit_code = EXIT_USAGE


def output_option(func: Callable) -> Callable:
    """Adds `-o/--output normal|json` and `--json` (shorthand) to a command."""
    func = click.option("--json", "as_json", is_flag=True, help="Same as -o json.")(func)
    func = click.option("-o", "--output", type=click.Choice(["normal", "json"]), default="normal",
                        show_default=True, help="Output format.")(func)
    return func


def wants_json(output: str, as_json: bool) -> bool:
    return as_json or output == "json"


def emit(data: Any, as_json: bool, normal: Callable[[Any], None]) -> None:
    """Print `data` as JSON or through the command's own human printer."""
    if as_json:
        json.dump(data, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        normal(data)


def root_option(func: Callable) -> Callable:
    """Adds `--root DIR`: read (and for setup/bind, change) the system rooted at DIR instead of `/`."""
    return click.option("--root", "root", type=click.Path(file_okay=False, path_type=str), default="/",
                        show_default=True, help="System root to inspect (a chroot or a test tree).")(func)
