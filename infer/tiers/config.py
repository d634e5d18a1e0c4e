"""The settings of a streaming run (what `ntransformer --streaming ...` gives, see infer/cli_options.py).
Importing this module pulls in neither NumPy nor CuPy."""

from __future__ import annotations

from dataclasses import dataclass

from infer.tiers.plan import DEFAULT_SLOTS

SOURCES = ("file", "nvme", "mmap")  # tier C sources (tier_c.py)
CPU_TIER_MODES = ("auto", "off")  # --cpu-tier; or a row count (infer.tiers.cpu_tier)


def parse_cpu_tier(text: str | int) -> str | int:
    """--cpu-tier's value: "auto" (measured at load), "off", or a row count: passes of at most that
    many rows compute the RAM layers on the CPU, without a measurement."""
    if isinstance(text, int) and text > 0:
        return text
    text = str(text).strip().lower()
    if text in CPU_TIER_MODES:
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ValueError(f"--cpu-tier takes auto, off or a number of rows (passes of at most that many rows compute "
                     f"the layers held in RAM on the CPU), not '{text}'")


@dataclass
class StreamingConfig:
    enabled: bool = False
    vram_budget: str | None = None
    ram_budget: str | None = None
    tier_c: str = "file"
    nvme_device: str | None = None
    nvme_lba: int | None = None  # the header's LBA (default: the first model of the device's chain)
    tier_b: str = "auto"
    slots: int = DEFAULT_SLOTS
    batch: int = 1
    prompts_file: str | None = None
    # tier C reads: requests in flight in the reader (None: its default, 8) and host staging buffers
    # (whole streamed tensors read ahead of the ring, counted in the RAM budget). 16 x 8 reads faster
    # on a large model (docs/PERFORMANCE.md); the defaults stay 8 x 4, which small budgets assume.
    read_queue_depth: int | None = None
    staging_buffers: int = 4
    # --tier-c nvme: GPU threads ring the controller's doorbells (reader/gpu_doorbell_backend.py);
    # falls back to CPU doorbells, with one note, when the probe names a blocker.
    gpu_doorbells: bool = False
    # mixture-of-experts files: where the router statistics live (None: the default file named after
    # the routers, infer.tiers.expert_policy.default_use_path; "off": none)
    expert_stats: str | None = None
    # ... on the GPU: which blocks' experts go to VRAM, the rest computed by the CPU from the tiered
    # cache: "auto" (as many as the VRAM budget holds), "cpu" (none: --cpu-moe), N (all but the first
    # N: --n-cpu-moe N)
    experts: str | int = "auto"
    # streamed layers held in RAM computed by the CPU in small passes (infer.tiers.cpu_tier):
    # "auto" (from the CPU's and the link's speeds, measured at load), "off", or a row count; off
    # unless asked for (the CLI's generation asks for auto), as its passes sum in another order
    cpu_tier: str | int = "off"
