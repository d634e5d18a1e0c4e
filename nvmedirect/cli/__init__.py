"""The `nvmedirect` command: a click group whose subcommands live one per module.

Subcommands are imported only when run, so `nvmedirect --help` stays fast and a broken optional
dependency (CuPy, say) cannot take down unrelated commands.
"""

from __future__ import annotations

import importlib

import click

from nvmedirect.cli.common import EXIT_FAILED, EXIT_NOT_READY, EXIT_REFUSED, EXIT_USAGE

# name -> "module:attribute"; the help line is kept here so `--help` needs no imports.
COMMANDS: dict[str, tuple[str, str]] = {
    "list": ("nvmedirect.cli.listing:list_cmd", "List NVMe controllers with a safety verdict each."),
    "check": ("nvmedirect.cli.check:check_cmd", "Report whether this system is ready (read-only)."),
    "setup": ("nvmedirect.cli.setup:setup_cmd", "Plan, apply or roll back system configuration."),
    "bind": ("nvmedirect.cli.bind:bind_cmd", "Hand an NVMe controller to vfio-pci."),
    "restore": ("nvmedirect.cli.bind:restore_cmd", "Give a controller back to the kernel nvme driver."),
    "identify": ("nvmedirect.cli.identify:identify_cmd", "Identify a vfio-bound controller and namespaces."),
    "write-gguf": ("nvmedirect.cli.gguf_store:write_gguf_cmd", "Write a GGUF model to raw LBAs."),
    "ls-gguf": ("nvmedirect.cli.gguf_store:ls_gguf_cmd", "List GGUF models stored on a device."),
    "bench": ("nvmedirect.cli.bench:bench_cmd", "Benchmark NVMe to pinned memory (and GPU) bandwidth."),
}


class LazyGroup(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        from nvmedirect.errors import notices_as_lines

        with notices_as_lines():  # the driver's notices (fewer queue pairs, no O_DIRECT): one line each
            return super().invoke(ctx)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        target, _ = COMMANDS[name]
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise

            @click.command(name=name, help=COMMANDS[name][1] + " (not available in this build)")
            def missing() -> None:
                raise click.ClickException(f"`{name}` is not implemented in this version")

            return missing
        return getattr(module, attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="nvmedirect")
def main() -> None:
    """User-space NVMe over VFIO: check a system, bind a drive, store and stream GGUF models.

    \b
    Exit codes: 0 ok, 1 failed, 2 usage error or bad input, 3 refused for safety,
    4 system not ready.
    """


__all__ = ["main", "EXIT_FAILED", "EXIT_NOT_READY", "EXIT_REFUSED", "EXIT_USAGE"]
