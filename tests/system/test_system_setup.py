"""`nvmedirect setup` against a fake root: plan, apply, re-apply, rollback, and refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from nvmedirect.cli import main

GRUB = """# If you change this file, run 'update-grub' afterwards.
GRUB_DEFAULT=0
GRUB_TIMEOUT=5
GRUB_DISTRIBUTOR=`lsb_release -i -s 2> /dev/null || echo Debian`
GRUB_CMDLINE_LINUX_DEFAULT="quiet amd_iommu=off splash"
GRUB_CMDLINE_LINUX=""
"""

# The shape of nv_follow_pfn() in NVIDIA driver sources that still call follow_pfn().
MLOCK_OLD = """#include "os-interface.h"
#include "nv-linux.h"

static inline int nv_follow_pfn(struct vm_area_struct *vma,
                                unsigned long address,
                                unsigned long *pfn)
{
#if defined(NV_UNSAFE_FOLLOW_PFN_PRESENT)
    return unsafe_follow_pfn(vma, address, pfn);
#else
    return follow_pfn(vma, address, pfn);
#endif
}
"""

MATH_H = """#if !defined(__MATH_FUNCTIONS_H__)
extern __DEVICE_FUNCTIONS_DECL__ __device_builtin__ double                 sqrt(double x) __THROW;
extern __DEVICE_FUNCTIONS_DECL__ __device_builtin__ double                 rsqrt(double x);
extern __DEVICE_FUNCTIONS_DECL__ __device_builtin__ float                  rsqrtf(float x);
#endif
"""


def make_root(root: Path, kernel: str = "6.12.9-amd64", glibc_minor: int = 42) -> Path:
    files = {
        "etc/default/grub": GRUB,
        "etc/modprobe.d/blacklist.conf": "blacklist pcspkr\n",
        "proc/cpuinfo": "processor : 0\nvendor_id : AuthenticAMD\n",
        "proc/sys/kernel/osrelease": kernel + "\n",
        "usr/include/features.h": f"#define __GLIBC__ 2\n#define __GLIBC_MINOR__ {glibc_minor}\n",
        "usr/src/nvidia-550.120/nvidia/os-mlock.c": MLOCK_OLD,
        "usr/local/cuda-12.8/targets/x86_64-linux/include/crt/math_functions.h": MATH_H,
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    os.chmod(root / "etc/default/grub", 0o600)  # an unusual mode must survive apply and rollback
    os.symlink("cuda-12.8", root / "usr/local/cuda")
    (root / "sys/bus/pci/devices").mkdir(parents=True)
    return root


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    out = {}
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(root))] = (path.read_bytes(), path.stat().st_mode & 0o7777)
    return out


def run(root: Path, *args: str):
    return CliRunner().invoke(main, ["setup", "--root", str(root), *args], catch_exceptions=False)


FULL = ("--iommu", "passthrough", "--patch-nvidia", "--patch-cuda")
PLANNED = {"etc/default/grub", "etc/modules-load.d/nvmedirect.conf", "etc/modprobe.d/nvmedirect.conf",
           "usr/src/nvidia-550.120/nvidia/os-mlock.c",
           "usr/local/cuda-12.8/targets/x86_64-linux/include/crt/math_functions.h"}


@pytest.fixture
def root(tmp_path) -> Path:
    return make_root(tmp_path / "root")


def test_plan_changes_nothing_and_explains_each_step(root):
    before = snapshot(root)
    result = run(root, *FULL)
    assert result.exit_code == 0, result.output
    assert snapshot(root) == before
    assert result.output.count("why:") == result.output.count("risk:") == result.output.count("undo:") == 5
    assert '+GRUB_CMDLINE_LINUX_DEFAULT="quiet splash iommu=pt"' in result.output
    assert "then: update-grub" in result.output
    assert "[skipped] load-vfio-now" in result.output  # runtime steps never touch a fake root


def test_apply_edits_exactly_the_planned_files_then_is_a_no_op_then_rolls_back(root):
    before = snapshot(root)
    plan = json.loads(run(root, *FULL, "--json").output)
    assert {f.lstrip("/") for s in plan["steps"] for f in s["files"]} == PLANNED

    applied = run(root, *FULL, "--apply", "--yes")
    assert applied.exit_code == 0, applied.output
    after = snapshot(root)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert {p for p in changed if not p.startswith("var/lib/nvmedirect/")} == PLANNED
    assert f"run update-grub inside {root}" in applied.output
    assert 'GRUB_CMDLINE_LINUX_DEFAULT="quiet splash iommu=pt"\n' in (root / "etc/default/grub").read_text()
    assert after["etc/default/grub"][1] == 0o600
    modprobe = (root / "etc/modprobe.d/nvmedirect.conf").read_text()
    assert "options vfio-pci disable_idle_d3=1" in modprobe and "noiommu" not in modprobe
    mlock = (root / "usr/src/nvidia-550.120/nvidia/os-mlock.c").read_text()
    assert "follow_pfnmap_start(&args)" in mlock and "return follow_pfn(" not in mlock
    assert "unsafe_follow_pfn" in mlock  # the branch for older kernels stays
    math = (root / "usr/local/cuda/targets/x86_64-linux/include/crt/math_functions.h").read_text()
    assert "double                 rsqrt(double x) noexcept(true);" in math
    assert "float                  rsqrtf(float x) noexcept(true);" in math
    assert "sqrt(double x) __THROW;" in math

    again = run(root, *FULL, "--apply", "--yes")
    assert again.exit_code == 0 and "nothing to do" in again.output
    assert snapshot(root) == after
    assert again.output.count("[done]") == 5

    back = run(root, "--rollback", "--yes")
    assert back.exit_code == 0, back.output
    assert snapshot(root) == before  # byte-identical, same modes, journal and backups gone


def test_two_applies_roll_back_to_the_first_originals(root):
    before = snapshot(root)
    assert run(root, "--iommu", "on", "--apply", "--yes").exit_code == 0
    assert 'DEFAULT="quiet splash"' in (root / "etc/default/grub").read_text()  # AMD: on is the default
    assert run(root, "--iommu", "off", "--unsafe-noiommu", "--apply", "--yes").exit_code == 0
    assert "enable_unsafe_noiommu_mode=1" in (root / "etc/modprobe.d/nvmedirect.conf").read_text()
    assert 'DEFAULT="quiet splash amd_iommu=off"' in (root / "etc/default/grub").read_text()
    assert run(root, "--rollback", "--yes").exit_code == 0
    assert snapshot(root) == before


def test_rollback_refuses_to_overwrite_later_edits_unless_forced(root):
    before = snapshot(root)
    assert run(root, "--apply", "--yes").exit_code == 0
    (root / "etc/modprobe.d/nvmedirect.conf").write_text("options vfio-pci ids=dead:beef\n")
    result = run(root, "--rollback", "--yes")
    assert result.exit_code == 3 and "changed since setup wrote them: /etc/modprobe.d/nvmedirect.conf" in result.output
    assert (root / "etc/modprobe.d/nvmedirect.conf").exists()
    assert run(root, "--rollback", "--yes", "--force").exit_code == 0
    assert snapshot(root) == before


def test_intel_passthrough_and_single_quotes(root):
    (root / "proc/cpuinfo").write_text("vendor_id : GenuineIntel\n")
    (root / "etc/default/grub").write_text("GRUB_CMDLINE_LINUX_DEFAULT='quiet'\n")
    assert run(root, "--iommu", "passthrough", "--apply", "--yes").exit_code == 0
    assert (root / "etc/default/grub").read_text() == 'GRUB_CMDLINE_LINUX_DEFAULT="quiet intel_iommu=on iommu=pt"\n'


def test_grub_line_with_shell_expansion_is_refused(root):
    (root / "etc/default/grub").write_text('GRUB_CMDLINE_LINUX_DEFAULT="$EXTRA quiet"\n')
    before = snapshot(root)
    result = run(root, "--iommu", "on", "--apply", "--yes")
    assert result.exit_code == 3 and "shell expansion" in result.output
    assert snapshot(root) == before


def test_no_grub_file_is_skipped_with_instructions(root):
    (root / "etc/default/grub").unlink()
    result = run(root, "--iommu", "off")
    assert "[skipped] grub-cmdline" in result.output and "amd_iommu=off" in result.output


@pytest.mark.parametrize("body,status,why", [
    ("    return -EINVAL; /* someone's earlier hack */\n", "refused", "does not look like a driver version"),
    ("#if defined(NV_FOLLOW_PFN_PRESENT)\n    return follow_pfn(vma, address, pfn);\n#else\n"
     "    return nv_follow_flavors(vma, address, pfn);\n#endif\n", "skipped", "already handles kernels"),
])
def test_nvidia_patch_recognises_only_known_texts(root, body, status, why):
    path = root / "usr/src/nvidia-550.120/nvidia/os-mlock.c"
    path.write_text(MLOCK_OLD.split("{\n")[0] + "{\n" + body + "}\n")
    before = snapshot(root)
    plan = json.loads(run(root, "--patch-nvidia", "--json").output)
    [step] = [s for s in plan["steps"] if s["key"] == "patch-nvidia-mlock"]
    assert step["status"] == status and why in step["note"]
    result = run(root, "--patch-nvidia", "--apply", "--yes")
    assert result.exit_code == (3 if status == "refused" else 0)
    assert path.read_bytes() == before["usr/src/nvidia-550.120/nvidia/os-mlock.c"][0]


def test_nvidia_patch_not_needed_before_6_12(tmp_path):
    root = make_root(tmp_path / "r", kernel="6.6.30")
    plan = json.loads(run(root, "--patch-nvidia", "--json").output)
    [step] = [s for s in plan["steps"] if s["key"] == "patch-nvidia-mlock"]
    assert step["status"] == "skipped" and "still has follow_pfn" in step["note"]


@pytest.mark.parametrize("text,status,why", [
    (MATH_H + MATH_H.splitlines()[2] + "\n", "refused", "does not declare rsqrt/rsqrtf the way"),
    (MATH_H.replace("rsqrt(double x);", "rsqrt(double x) _NV_RSQRT_SPECIFIER;"), "skipped", "13.2+"),
    (MATH_H.replace("rsqrt(double x);", "rsqrt(double x, int y);"), "refused", "does not declare"),
])
def test_cuda_patch_recognises_only_known_texts(root, text, status, why):
    path = root / "usr/local/cuda-12.8/targets/x86_64-linux/include/crt/math_functions.h"
    path.write_text(text)
    plan = json.loads(run(root, "--patch-cuda", "--json").output)
    [step] = [s for s in plan["steps"] if s["key"] == "patch-cuda-math"]
    assert step["status"] == status and why in step["note"]
    assert run(root, "--patch-cuda", "--apply", "--yes").exit_code == (3 if status == "refused" else 0)
    assert path.read_text() == text


def test_cuda_patch_not_needed_with_old_glibc(tmp_path):
    root = make_root(tmp_path / "r", glibc_minor=36)
    plan = json.loads(run(root, "--patch-cuda", "--json").output)
    [step] = [s for s in plan["steps"] if s["key"] == "patch-cuda-math"]
    assert step["status"] == "skipped" and "2.36" in step["note"]


def test_nvme_only_plans_just_modules_and_binding(root):
    plan = json.loads(run(root, "--nvme-only", "--json").output)
    assert [s["key"] for s in plan["steps"]] == ["load-vfio-now"]


def test_bind_step_of_unknown_device_is_refused(root):
    result = run(root, "--nvme-only", "--bind", "/dev/nvme9n1", "--apply", "--yes")
    assert result.exit_code == 3 and "no NVMe controller owns" in result.output


def test_rollback_with_other_options_is_a_usage_error(root):
    assert run(root, "--rollback", "--apply").exit_code == 2


# The parts of Linux 6.12's <linux/mm.h> the patched function uses (declarations only).
FOLLOW_PFNMAP_API = """
struct vm_area_struct;
struct follow_pfnmap_args {
    struct vm_area_struct *vma;
    unsigned long address;
    unsigned long pfn;
    int writable;
};
int follow_pfnmap_start(struct follow_pfnmap_args *args);
void follow_pfnmap_end(struct follow_pfnmap_args *args);
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_patched_nv_follow_pfn_compiles_against_the_follow_pfnmap_api(root, tmp_path):
    assert run(root, "--patch-nvidia", "--apply", "--yes").exit_code == 0
    patched = (root / "usr/src/nvidia-550.120/nvidia/os-mlock.c").read_text()
    body = patched[patched.index("static inline int nv_follow_pfn"):]
    source = tmp_path / "mlock.c"
    source.write_text(FOLLOW_PFNMAP_API + body + "int use(struct vm_area_struct *v, unsigned long *p) "
                      "{ return nv_follow_pfn(v, 0, p); }\n")
    done = subprocess.run(["gcc", "-std=gnu11", "-Wall", "-Werror", "-fsyntax-only", str(source)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
