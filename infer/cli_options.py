"""The streaming command-line options as one reusable click decorator. Importing this module pulls
in neither NumPy nor CuPy, so a command line can use the decorator and still set BLAS threads
before NumPy loads.

    @click.command()
    @streaming_options
    def main(..., streaming: StreamingConfig) -> None: ...
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from infer.tiers.config import SOURCES, StreamingConfig
from infer.tiers.plan import DEFAULT_SLOTS

_OPTION_NAMES = ("streaming", "vram_budget", "ram_budget", "tier_c", "nvme_device", "nvme_lba", "tier_b", "slots",
                 "batch", "prompts_file", "gpu_doorbells", "expert_stats", "cpu_tier")
EXIT_BAD_INPUT = 2  # infer/cli.py's code for a bad flag


class OptionConflict(click.ClickException):
    """Flags that cannot be combined: one `Error: ...` line and exit 2, as infer/cli.py's errors."""

    exit_code = EXIT_BAD_INPUT


def check_gpu_doorbells(config: StreamingConfig, device: str | None) -> None:
    """--gpu-doorbells needs the NVMe tier C and a GPU to ring its doorbells."""
    if not config.gpu_doorbells:
        return
    if config.tier_c != "nvme":
        raise OptionConflict(f"--gpu-doorbells reads tier C from an NVMe drive: add --tier-c nvme "
                             f"(not {config.tier_c})")
    if device == "cpu":
        raise OptionConflict("--gpu-doorbells needs GPU threads to ring the doorbells: drop --device cpu")


def check_cpu_tier(ctx: click.Context, device: str | None) -> None:
    """--cpu-tier chooses where the GPU engine computes its RAM layers: refused with --device cpu,
    where every layer is the CPU's anyway."""
    given = ctx.get_parameter_source("cpu_tier") not in (None, click.core.ParameterSource.DEFAULT)
    if given and device == "cpu":
        raise OptionConflict("--cpu-tier sets where the GPU's streaming engine computes the layers held in RAM; "
                             "with --device cpu every layer is computed by the CPU: drop it")


# flags that only the streaming engine reads: without --streaming (or --batch/--prompts, which
# run it) they would be ignored, so they are refused instead
_STREAMING_ONLY = {"ram_budget": "--ram-budget", "tier_c": "--tier-c", "nvme_device": "--nvme-device",
                   "nvme_lba": "--nvme-lba", "tier_b": "--tier-b", "slots": "--slots",
                   "gpu_doorbells": "--gpu-doorbells", "expert_stats": "--expert-stats",
                   "cpu_tier": "--cpu-tier"}


def check_sizes(values: dict[str, Any]) -> None:
    """--vram-budget and --ram-budget must read as sizes on every path, used or not."""
    from infer.tiers.budget import BudgetError, parse_size  # no NumPy behind it: BLAS threads are still unset

    for name, flag in (("vram_budget", "--vram-budget"), ("ram_budget", "--ram-budget")):
        if values.get(name) is not None:
            # --vram-budget with --gpus: one size per GPU, separated by commas
            parts = values[name].split(",") if name == "vram_budget" else [values[name]]
            try:
                for part in parts:
                    parse_size(part.strip())
            except BudgetError as err:
                raise OptionConflict(f"{flag}: {err}") from None


def check_streaming_only(ctx: click.Context, values: dict[str, Any]) -> None:
    """A flag of the streaming engine given without it is an error, not silently ignored."""
    streamed = values["streaming"] or values.get("batch", 1) > 1 or values.get("prompts_file")
    if streamed:
        return
    given = [flag for name, flag in _STREAMING_ONLY.items()
             if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)]
    if given:
        raise OptionConflict(f"{', '.join(given)} {'sets' if len(given) == 1 else 'set'} the streaming engine's "
                             "tiers: add --streaming")


def _cpu_tier_value(ctx: click.Context, param: click.Parameter, value: str) -> str | int:
    from infer.tiers.config import parse_cpu_tier

    try:
        return parse_cpu_tier(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def streaming_options(func: Callable[..., Any] | None = None, *, batch: bool = True) -> Any:
    """Adds --streaming, --vram-budget, --ram-budget, --tier-c, --nvme-device, --tier-b, --slots,
    --batch, --prompts, --gpu-doorbells and --expert-stats; the command receives them as one `streaming: StreamingConfig`.
    `@streaming_options(batch=False)` leaves out --batch and --prompts (a server batches its requests)."""
    if func is None:
        return functools.partial(streaming_options, batch=batch)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = {name: kwargs.pop(name, None) for name in _OPTION_NAMES}
        if not batch:
            values["batch"], values["prompts_file"] = 1, None
        check_sizes(values)
        check_streaming_only(click.get_current_context(), values)
        kwargs["streaming"] = StreamingConfig(
            enabled=values["streaming"], vram_budget=values["vram_budget"], ram_budget=values["ram_budget"],
            tier_c=values["tier_c"], nvme_device=values["nvme_device"], nvme_lba=values["nvme_lba"],
            tier_b=values["tier_b"],
            slots=values["slots"], batch=values["batch"], prompts_file=values["prompts_file"],
            gpu_doorbells=values["gpu_doorbells"], expert_stats=values["expert_stats"], cpu_tier=values["cpu_tier"])
        check_gpu_doorbells(kwargs["streaming"], kwargs.get("device"))
        check_cpu_tier(click.get_current_context(), kwargs.get("device"))
        return func(*args, **kwargs)

    options = [
        click.option("--streaming", is_flag=True, help="Stream weights that do not fit in VRAM through a 3-tier "
                     "cache (VRAM, pinned RAM, storage). A mixture of experts tiers its experts instead: those the "
                     "CPU computes are held in RAM up to --ram-budget and read from --tier-c when routed to."),
        click.option("--vram-budget", metavar="SIZE", help="Device memory the engine may use, e.g. 24GB "
                     "(default: free VRAM)."),
        click.option("--ram-budget", metavar="SIZE", help="Host memory for tier B and staging, e.g. 48GiB "
                     "(default: available RAM); for a mixture of experts, the experts held in RAM (default: a "
                     "quarter of them)."),
        click.option("--tier-c", type=click.Choice(SOURCES), default="file", show_default=True,
                     help="Where tier C weights are read from: the file with O_DIRECT, the NVMe copy written by "
                     "`nvmedirect write-gguf`, or the naive mmap baseline."),
        click.option("--nvme-device", metavar="BDF|DEV", help="Device holding the model for --tier-c nvme."),
        click.option("--nvme-lba", type=click.IntRange(min=0), help="LBA of the model's header on --nvme-device "
                     "(default: the first model stored from LBA 0)."),
        click.option("--gpu-doorbells", is_flag=True, help="--tier-c nvme: GPU threads issue the reads (build "
                     "SQEs, ring the doorbells through BAR0 mapped for the GPU); falls back to CPU doorbells, "
                     "saying why, when `nvmedirect check --probe-gpu-mmio` would fail."),
        click.option("--tier-b", type=click.Choice(["auto", "pinned", "registered"]), default="auto",
                     show_default=True, help="Tier B as a pinned copy or the registered file mapping."),
        click.option("--slots", type=click.IntRange(2, 64), default=DEFAULT_SLOTS, show_default=True,
                     help="Device slots in the streaming ring."),
        click.option("--expert-stats", metavar="FILE|off", help="Mixture-of-experts files: the router statistics "
                     "that rank experts for RAM (read at start, the most used preloaded; updated and written back "
                     "at the end). Default: a file named after the routers under ~/.cache/nvmedirect/expert-use; "
                     "'off' keeps none."),
        click.option("--cpu-tier", metavar="auto|off|N", default="auto" if batch else "off", show_default=True,
                     callback=_cpu_tier_value,
                     help="GPU streaming: layers held in RAM are computed by the CPU in passes of few tokens "
                     "(decode) and streamed in larger ones (prompts, batches, speculation trees). auto: from the "
                     "CPU's and the link's speeds measured at load, the CPU takes the share of those layers it can "
                     "compute while the link copies the rest, up to the pass size where that stops paying; N: "
                     "every RAM layer on the CPU in passes of at most N tokens; off: always streamed. A pass on "
                     "the CPU computes with the CPU engine's products "
                     "(logits about 1% apart from the GPU's at 8-bit types), so `serve` defaults to off (its "
                     "replies must not depend on the load), and so does speculation (--draft-model/--lookup: "
                     "its text must be plain decoding's) unless this is given."),
    ]
    if batch:
        options += [
            click.option("--batch", type=click.IntRange(1, 4096), default=1, show_default=True,
                         help="Sequences decoded together (copies of the prompt unless --prompts is given)."),
            click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False),
                         help="File with one prompt per line; each becomes a sequence of the batch."),
        ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper
