"""Bandwidth and CPU cost of our user-space driver against the kernel's nvme driver, on QEMU's
emulated NVMe, for each transfer limit (MDTS) and request size.

On the host it boots the test VM (tests/vm/rig.py) with one controller per MDTS, all backed by
copies of one random image, and runs itself inside; in the guest it measures, per controller and
block size:
  - kernel: `dd iflag=direct bs=BLOCK` from the namespace block device: one request at a time,
    which the block layer splits at MDTS and submits together;
  - ours, one request at a time: the same requests through VFIO, each one's commands in flight
    together (what dd asks of the kernel);
  - ours, QD 1: one command at a time;
  - ours, QD N: N commands in flight across requests;
then prints GB/s, CPU seconds per GB (of the reading process, and of the whole guest from
/proc/stat, which includes the kernel's interrupt work) and the ratio to the kernel. Every run
reads the same bytes into a reused 16 MiB buffer; the controller is moved between the two drivers
(unbind/bind) once per round, and the best of the rounds counts (the host is shared).

    python bench/nvme_vm.py [--mode iommu|noiommu] [--mdts 1 2 7] [--block-kib 128 1024]
                            [--total-mib 128] [--depth 32] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT_NAME = "nvme_vm_bench.json"
PATHS = ("kernel", "ours_request", "ours_qd1", "ours")
BUFFER_BYTES = 16 << 20


def serial(mdts: int) -> str:
    return f"nvd-bench-mdts{mdts}"


# -- guest side ------------------------------------------------------------------------------------
def guest_cpu_s() -> float:
    """Non-idle CPU time of the whole guest (all CPUs; user, system, interrupts), in seconds."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def kernel_dd(device: str, block: int, total: int) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    guest_before = guest_cpu_s()
    started = time.monotonic()
    subprocess.run(["dd", f"if={device}", "of=/dev/null", f"bs={block}", f"count={total // block}",
                    "iflag=direct", "status=none"], check=True)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "guest_cpu_s": guest_cpu_s() - guest_before}


def ours(ns, qpair, slots: list, block: int, total: int, depth: int | None) -> dict:
    """Read `total` bytes in `block`-sized requests, request i into `slots[i % len(slots)]`: with
    `depth` commands in flight across requests, or (depth None) one request at a time, all its
    commands in flight together."""
    lbas_per_block = block // ns.lba_size
    requests = total // block
    doorbells = qpair.doorbell_writes
    commands = 0
    started_cpu, started_guest = time.process_time(), guest_cpu_s()
    started = time.monotonic()
    if depth is None:
        per_request = -(-lbas_per_block // ns.max_blocks)
        batches = []
        for slot in slots:  # one batch per slot, reused: only the LBA changes
            batch = ns.batch()
            batch.add_direct(0, lbas_per_block, slot)
            batches.append((batch, batch.extents[0]))
        for index in range(requests):
            batch, extent = batches[index % len(slots)]
            extent.slba = index * lbas_per_block
            commands += qpair.run(batch, per_request)
    else:
        batch = ns.batch()
        for index in range(requests):
            batch.add_direct(index * lbas_per_block, lbas_per_block, slots[index % len(slots)])
        commands = qpair.run(batch, depth)
    wall, cpu, guest = time.monotonic() - started, time.process_time() - started_cpu, guest_cpu_s() - started_guest
    sq, cq = (after - before for after, before in zip(qpair.doorbell_writes, doorbells, strict=True))
    return {"wall_s": wall, "cpu_s": cpu, "guest_cpu_s": guest, "commands": commands, "sq_doorbells": sq,
            "cq_doorbells": cq}


def namespace_device(bdf: str, timeout_s: float = 30.0) -> str:
    """The block device of namespace 1, once the nvme driver's asynchronous probe has made it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = sorted(Path(f"/sys/bus/pci/devices/{bdf}/nvme").glob("nvme*/nvme*n1"))
        if names and os.path.exists(f"/dev/{names[0].name}"):
            return f"/dev/{names[0].name}"
        time.sleep(0.05)
    raise SystemExit(f"bench: no namespace block device under {bdf} {timeout_s:.0f} s after binding nvme")


def best(runs: list[dict]) -> dict:
    """The fastest of repeated runs: the host is shared, so slow outliers are noise, not the driver."""
    return min(runs, key=lambda run: run["wall_s"])


def measure(bdf: str, noiommu: bool, blocks: list[int], total: int, depth: int, repeats: int,
            idle_sleep_s: float = 0.0) -> list[dict]:
    """Alternate kernel and user-space phases `repeats` times; keep the best run of each path."""
    import vmguest

    from nvmedirect.nvme.controller import Controller

    runs: dict[tuple[int, str], list[dict]] = {}
    max_transfer = 0
    for _ in range(repeats):
        vmguest.bind(bdf, "nvme")
        device = namespace_device(bdf)
        for block in blocks:
            runs.setdefault((block, "kernel"), []).append(kernel_dd(device, block, total))
        vmguest.bind(bdf, "vfio-pci")
        with Controller.open(bdf, noiommu=noiommu, poll_idle_sleep_s=idle_sleep_s) as ctrl:
            max_transfer = ctrl.max_transfer
            ns = ctrl.namespace(1)
            widest = max(-(-block // max_transfer) for block in blocks)  # commands of one request
            qpair = ctrl.create_io_qpair(max(depth, widest) + 1)
            buffer = ctrl.dma.alloc(BUFFER_BYTES)
            slots = {block: [buffer[at:at + block] for at in range(0, BUFFER_BYTES - block + 1, block)]
                     for block in blocks}
            ours(ns, qpair, slots[blocks[0]], blocks[0], 4 << 20, depth)  # warm-up: page in, build caches
            for block in blocks:
                for path, qd in (("ours_request", None), ("ours_qd1", 1), ("ours", depth)):
                    runs.setdefault((block, path), []).append(ours(ns, qpair, slots[block], block, total, qd))
            buffer.free()
    vmguest.restore_kernel_driver(bdf)
    return [{"block": block, "max_transfer": max_transfer, "repeats": repeats,
             **{path: best(runs[(block, path)]) for path in PATHS}} for block in blocks]


def guest_main(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO / "tests/vm/guest"))
    import vmguest

    Path("/proc/sys/vm/nr_hugepages").write_text("64")
    total = args.total_mib << 20
    found = vmguest.controllers()
    sweep = []
    for mdts in args.mdts:
        rows = measure(found[serial(mdts)]["bdf"], vmguest.vm_mode() == "noiommu",
                       [kib << 10 for kib in args.block_kib], total, args.depth, args.repeats,
                       args.idle_sleep_us / 1e6)
        sweep.append({"mdts": mdts, "rows": rows})
    return {"mode": vmguest.vm_mode(), "total_bytes": total, "depth": args.depth,
            "idle_sleep_us": args.idle_sleep_us, "repeats": args.repeats, "sweep": sweep}


# -- report ----------------------------------------------------------------------------------------
def describe(results: dict) -> str:
    total = results["total_bytes"]
    gb = total / 1e9
    labels = {"kernel": "kernel dd O_DIRECT", "ours_request": "ours, 1 request", "ours_qd1": "ours, QD 1",
              "ours": f"ours, QD {results['depth']}"}
    lines = [f"NVMe read bandwidth in the TCG guest ({results['mode']} mode, {total >> 20} MiB per run, "
             f"idle sleep {results.get('idle_sleep_us', 0):g} us, best of {results['repeats']})",
             f"{'MDTS':>4} {'max xfer':>8} {'block':>7} {'path':<18} {'GB/s':>7} {'vs kernel':>9} "
             f"{'CPU s/GB':>8} {'guest CPU s/GB':>14} {'doorbells/cmd':>13}"]
    for entry in results["sweep"]:
        for row in entry["rows"]:
            kernel_rate = gb / row["kernel"]["wall_s"]
            for path in PATHS:
                run = row[path]
                rate = gb / run["wall_s"]
                mmio = (f"{(run['sq_doorbells'] + run['cq_doorbells']) / run['commands']:>13.2f}"
                        if run.get("commands") else f"{'':>13}")
                lines.append(f"{entry['mdts']:>4} {row['max_transfer'] >> 10:>6}Ki {row['block'] >> 10:>5}Ki "
                             f"{labels[path]:<18} {rate:>7.3f} {rate / kernel_rate:>8.2f}x "
                             f"{run['cpu_s'] / gb:>8.2f} {run['guest_cpu_s'] / gb:>14.2f} {mmio}")
    return "\n".join(lines)


# -- host side -------------------------------------------------------------------------------------
def host_main(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO / "tests/vm"))
    import tempfile

    from rig import NvmeSpec, VmConfig, run_in_vm

    workdir = Path(tempfile.mkdtemp(prefix="nvd-bench-"))
    first = workdir / f"mdts{args.mdts[0]}.img"
    with open(first, "wb") as out:  # real data, so neither side reads holes
        for _ in range(args.total_mib):
            out.write(os.urandom(1 << 20))
    controllers = []
    for mdts in args.mdts:
        image = workdir / f"mdts{mdts}.img"
        if image != first:
            shutil.copyfile(first, image)
        controllers.append(NvmeSpec(serial(mdts), image=image, mdts=mdts))
    config = VmConfig(iommu=args.mode == "iommu", controllers=controllers)
    guest_args = ["python", str(Path(__file__).resolve()), "--guest", "--total-mib", str(args.total_mib),
                  "--depth", str(args.depth), "--repeats", str(args.repeats),
                  "--idle-sleep-us", str(args.idle_sleep_us), "--mdts", *map(str, args.mdts),
                  "--block-kib", *map(str, args.block_kib)]
    result = run_in_vm(config, guest_args, workdir, timeout=args.timeout)
    result.check()
    data = json.loads((result.results_dir / RESULT_NAME).read_text())
    print(describe(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["iommu", "noiommu"], default="iommu")
    parser.add_argument("--mdts", type=int, nargs="+", default=[1, 2, 7],
                        help="controllers' MDTS (2^N pages per command; QEMU's default is 7)")
    parser.add_argument("--total-mib", type=int, default=128, help="bytes read per run (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; the best run counts")
    parser.add_argument("--block-kib", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--depth", type=int, default=32, help="commands in flight for the deep run")
    parser.add_argument("--idle-sleep-us", type=float, default=0.0,
                        help="sleep after an empty poll spin (0: pure polling)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", metavar="FILE", help="also write the raw measurements to FILE")
    parser.add_argument("--guest", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.guest:
        results = guest_main(args)
        print(describe(results))
        Path(os.environ["NVMEDIRECT_VM_RESULTS"], RESULT_NAME).write_text(json.dumps(results))
        return 0
    return host_main(args)


if __name__ == "__main__":
    sys.exit(main())
