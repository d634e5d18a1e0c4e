#!/usr/bin/env python3
"""Build the test VM's kernel, initramfs and no-IOMMU VFIO modules, cached by kernel version.

    python3 scripts/vm/build_assets.py            # build unless the cache is current
    python3 scripts/vm/build_assets.py --check    # build nothing: exit 0 if current, 1 if not
    python3 scripts/vm/build_assets.py --force    # rebuild

Layout (CACHE = ${NVMEDIRECT_CACHE:-~/.cache/nvmedirect}):
    CACHE/vm/<kernel-version>/vmlinuz, initramfs.cpio.gz, config, manifest.json
    CACHE/vm/current -> <kernel-version>          (what tests/vm/rig.py boots)

The kernel is the one Debian's `linux-image-amd64` depends on, resolved now (it changes with
point releases). Debian builds VFIO without CONFIG_VFIO_NOIOMMU, so drivers/vfio is rebuilt out of
tree from linux-source with it switched on; both VFIO builds go into the initramfs and the guest's
/init picks one from the kernel command line. Everything is fetched with `apt-get download` and
unpacked with `dpkg -x`, so no root is needed here. A build happens in a temporary directory that is
renamed into place at the end: an interrupted build leaves no half cache. Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
INIT_SCRIPT = HERE / "init.sh"
BUSYBOX = Path("/bin/busybox")

# Modules the rig cannot work without, and the VFIO stack of each mode (dependencies are added).
BASE_MODULES = ["virtio_pci", "9pnet_virtio", "9p", "overlay", "nvme"]
VFIO_MODULES = ["vfio", "vfio_iommu_type1", "vfio-pci"]
# Loaded when present, for guest tests that stack block devices or filesystems on the NVMe.
EXTRA_MODULES = ["virtio_blk", "loop", "dm-mod", "md-mod", "raid0", "raid1", "ext4"]
# Bump when a change here alters what gets built; comments and refactors then cost no rebuild.
RECIPE_VERSION = 1


def log(message: str) -> None:
    print(f"vm-assets: {message}", flush=True)


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    """Run a command, return stdout; on failure raise with its stderr in the message."""
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"vm-assets: `{' '.join(map(str, cmd))}` failed:\n{proc.stderr.strip()}")
    return proc.stdout


def cache_root() -> Path:
    return Path(os.environ.get("NVMEDIRECT_CACHE", Path.home() / ".cache" / "nvmedirect")) / "vm"


def recipe_digest() -> str:
    """Changes with the guest's /init, the module lists or RECIPE_VERSION: stale caches get rebuilt."""
    digest = hashlib.sha256(INIT_SCRIPT.read_bytes())
    digest.update(repr((BASE_MODULES, VFIO_MODULES, EXTRA_MODULES, RECIPE_VERSION)).encode())
    return digest.hexdigest()[:16]


def resolve_kernel() -> tuple[str, str]:
    """(image package, kernel version) of the kernel Debian's linux-image-amd64 currently names."""
    package = os.environ.get("NVMEDIRECT_VM_KERNEL_PACKAGE")
    if not package:
        proc = subprocess.run(["apt-cache", "depends", "linux-image-amd64"], capture_output=True, text=True)
        found = re.search(r"Depends:\s*(linux-image-\S+)", proc.stdout)
        if not found:
            raise SystemExit("vm-assets: apt names no kernel for linux-image-amd64: run apt-get update "
                             "(a Debian archive is needed; NVMEDIRECT_VM_KERNEL_PACKAGE picks one by hand)")
        package = found.group(1)
    return package, package.removeprefix("linux-image-")


def apt_version(package: str) -> str:
    out = run("apt-cache", "show", "--no-all-versions", package)
    found = re.search(r"^Version:\s*(\S+)", out, re.M)
    if not found:
        raise SystemExit(f"vm-assets: apt knows no version of {package}; run apt-get update")
    return found.group(1)


def is_current(kdir: Path) -> bool:
    try:
        manifest = json.loads((kdir / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    files_present = all((kdir / name).is_file() for name in ("vmlinuz", "initramfs.cpio.gz"))
    return files_present and manifest.get("recipe") == recipe_digest()


def point_current(root: Path, kver: str) -> None:
    """Switch CACHE/vm/current atomically (a symlink renamed over the old one)."""
    tmp = root / f".current-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(kver)
    os.replace(tmp, root / "current")


def headers_packages(kver: str) -> list[str]:
    """The arch headers package and the -common and kbuild packages it depends on."""
    arch = f"linux-headers-{kver}"
    deps = re.findall(r"Depends:\s*(\S+)", run("apt-cache", "depends", arch))
    extra = [d for d in deps if re.fullmatch(r"linux-headers-.*-common|linux-kbuild-.*", d)]
    if len(extra) != 2:
        raise SystemExit(f"vm-assets: cannot tell the -common/kbuild packages of {arch} (found {extra})")
    return [arch, *extra]


def download(packages: list[str], version: str, dest: Path) -> list[Path]:
    """`apt-get download` every package at exactly `version`, so the modules match the kernel."""
    dest.mkdir(parents=True)
    run("apt-get", "download", "-q", *[f"{p}={version}" for p in packages], cwd=dest)
    debs = sorted(dest.glob("*.deb"))
    if len(debs) != len(packages):
        raise SystemExit(f"vm-assets: expected {len(packages)} packages in {dest}, got {len(debs)}")
    return debs


def build_noiommu_vfio(work: Path, sysroot: Path, kver: str, source_deb: Path) -> Path:
    """Compile drivers/vfio against the kernel's headers with CONFIG_VFIO_NOIOMMU; return the tree."""
    series = ".".join(kver.split(".")[:2])
    src = work / "vfio-src"
    src.mkdir()
    tarball = f"./usr/src/linux-source-{series}.tar.xz"
    inner = f"linux-source-{series}/drivers/vfio"
    # Only drivers/vfio is unpacked, but xz still has to decompress the whole tarball (~10 s).
    run("sh", "-c", 'dpkg-deb --fsys-tarfile "$0" | tar -xO "$1" | tar -xJ -C "$2" "$3"',
        source_deb, tarball, src, inner)
    tree = src / inner
    headers = sysroot / "usr/src" / f"linux-headers-{kver}"
    # The arch headers' Makefile includes the -common one by absolute path; point it at our copy.
    makefile = headers / "Makefile"
    makefile.write_text(makefile.read_text().replace("/usr/src/", f"{sysroot}/usr/src/"))
    log(f"compiling drivers/vfio with CONFIG_VFIO_NOIOMMU for {kver}")
    run("make", "-s", "-C", headers, f"M={tree}", f"-j{os.cpu_count() or 2}",
        # Not needed by the tests; skipping them keeps the build to the modules we load.
        "CONFIG_VFIO_MDEV=", "CONFIG_VFIO_PLATFORM=", "CONFIG_VFIO_FSL_MC=",
        "KCFLAGS=-DCONFIG_VFIO_NOIOMMU=1", "modules")
    return tree


def noiommu_module_root(work: Path, sysroot: Path, kver: str, vfio_tree: Path) -> Path:
    """A module tree (hard links to the stock one) whose drivers/vfio holds the rebuilt modules."""
    root = work / "noiommu-root"
    stock = sysroot / "lib/modules" / kver
    dest = root / "lib/modules" / kver
    dest.parent.mkdir(parents=True)
    shutil.copytree(stock, dest, copy_function=os.link)
    target = dest / "kernel/drivers/vfio"
    for ko in vfio_tree.rglob("*.ko"):
        placed = target / ko.relative_to(vfio_tree)
        placed.unlink(missing_ok=True)
        shutil.copy2(ko, placed)
    if "enable_unsafe_noiommu_mode" not in run("modinfo", "-p", target / "vfio.ko"):
        raise SystemExit("vm-assets: the rebuilt vfio.ko has no enable_unsafe_noiommu_mode parameter")
    run("depmod", "-b", root, kver)
    return root


def load_order(module_root: Path, kver: str, names: list[str], optional: bool = False) -> list[Path]:
    """Module files to insmod, dependencies first, without repeats."""
    order: list[Path] = []
    for name in names:
        proc = subprocess.run(["modprobe", "-d", str(module_root), "-S", kver, "--show-depends", name],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            if optional:
                continue
            raise SystemExit(f"vm-assets: module {name} not found for {kver}: {proc.stderr.strip()}")
        for line in proc.stdout.splitlines():
            if line.startswith("insmod "):
                path = Path(line.split()[1])
                if path not in order:
                    order.append(path)
    return order


def pack_initramfs(work: Path, out: Path, lists: dict[str, tuple[Path, list[Path]]]) -> None:
    """busybox + /init + the listed modules (each list keeps its own copies, under its own prefix)."""
    stage = work / "initramfs"
    (stage / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, stage / "bin/busybox")
    shutil.copy2(INIT_SCRIPT, stage / "init")
    (stage / "init").chmod(0o755)
    for list_name, (module_root, modules) in lists.items():
        prefix = "noiommu" if list_name == "vfio-noiommu" else "stock"
        entries = []
        for ko in modules:
            rel = Path(prefix) / ko.relative_to(module_root)
            (stage / "modules" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ko, stage / "modules" / rel)
            entries.append(str(rel))
        (stage / "modules" / f"{list_name}.list").write_text("".join(f"{e}\n" for e in entries))
    run("sh", "-c", 'cd "$0" && find . | cpio -o -H newc --quiet | gzip -1 > "$1"', stage, out)


def build(root: Path, package: str, kver: str) -> Path:
    started = time.monotonic()
    version = apt_version(package)
    root.mkdir(parents=True, exist_ok=True)
    if not BUSYBOX.is_file():
        raise SystemExit("vm-assets: /bin/busybox missing: install busybox-static")
    with tempfile.TemporaryDirectory(prefix=f".build-{kver}-", dir=root) as tmp:
        work = Path(tmp)
        out = work / "out"
        out.mkdir()
        series = ".".join(kver.split(".")[:2])
        packages = [package, *headers_packages(kver), f"linux-source-{series}"]
        log(f"downloading {', '.join(packages)} ({version})")
        debs = download(packages, version, work / "debs")
        sysroot = work / "sysroot"
        source_deb = next(d for d in debs if d.name.startswith("linux-source-"))
        for deb in debs:
            if deb is not source_deb:
                run("dpkg", "-x", deb, sysroot)
        run("depmod", "-b", sysroot, kver)
        shutil.copy2(sysroot / "boot" / f"vmlinuz-{kver}", out / "vmlinuz")
        shutil.copy2(sysroot / "boot" / f"config-{kver}", out / "config")
        vfio_tree = build_noiommu_vfio(work, sysroot, kver, source_deb)
        nroot = noiommu_module_root(work, sysroot, kver, vfio_tree)
        lists = {
            "base": (sysroot, load_order(sysroot, kver, BASE_MODULES)),
            "vfio-iommu": (sysroot, load_order(sysroot, kver, VFIO_MODULES)),
            "vfio-noiommu": (nroot, load_order(nroot, kver, VFIO_MODULES)),
            "extra": (sysroot, load_order(sysroot, kver, EXTRA_MODULES, optional=True)),
        }
        pack_initramfs(work, out / "initramfs.cpio.gz", lists)
        manifest = {
            "kernel_version": kver, "kernel_package": package, "package_version": version,
            "recipe": recipe_digest(), "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(time.monotonic() - started, 1),
            "modules": {name: [str(p.name) for p in mods] for name, (_, mods) in lists.items()},
        }
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        final = root / kver
        if final.exists():  # a stale build: move it aside first, then drop it
            stale = work / "stale"
            os.rename(final, stale)
        os.rename(out, final)
    point_current(root, kver)
    log(f"built {final} in {time.monotonic() - started:.1f} s")
    return final


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="build nothing: exit 0 if the cache is current, else 1")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache is current")
    args = parser.parse_args()
    root = cache_root()
    package, kver = resolve_kernel()
    kdir = root / kver
    if is_current(kdir) and not args.force:
        point_current(root, kver)
        log(f"{kdir} is current")
        return 0
    if args.check:
        log(f"{kdir} needs a build")
        return 1
    build(root, package, kver)
    return 0


if __name__ == "__main__":
    sys.exit(main())
