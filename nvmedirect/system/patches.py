"""Opt-in source patches for two breakages the seed hit, applied only to files we recognise.

1. NVIDIA DKMS `os-mlock.c`: Linux 6.12 removed `follow_pfn()`. Driver versions whose
   `nv_follow_pfn()` has no other path then fail to build, or (patched carelessly) lose
   `cudaHostRegister(..., cudaHostRegisterIoMemory)`, which the GPU-MMIO doorbell path needs.
   We replace the call with the `follow_pfnmap_start()`/`follow_pfnmap_end()` API that 6.12 added.
2. CUDA `crt/math_functions.h`: glibc 2.41+ declares `rsqrt`/`rsqrtf` (C23) with `noexcept(true)`
   in C++; CUDA headers before 13.2 declare them without, and nvcc's host pass fails. We add
   `noexcept(true)` to those two declarations.

Each step recognises exact known texts: the unpatched form, our patched form, or a form that
needs no patch. Anything else is refused, because a patch to an unknown version could break the
driver or compiler silently.
"""

from __future__ import annotations

import re

from nvmedirect.system.journal import FileEdit
from nvmedirect.system.setup_steps import DONE, REFUSED, SKIPPED, Step, _changes
from nvmedirect.system.sysview import SystemView

NVIDIA_GLOBS = ("usr/src/nvidia-*/nvidia/os-mlock.c", "usr/src/nvidia-*/kernel-open/nvidia/os-mlock.c")
CUDA_GLOBS = ("usr/local/cuda*/targets/*/include/crt/math_functions.h", "usr/include/crt/math_functions.h")

# nv_follow_pfn() of the driver versions that call follow_pfn() with no other way out.
NVIDIA_UNPATCHED = (
    "#if defined(NV_UNSAFE_FOLLOW_PFN_PRESENT)\n"
    "    return unsafe_follow_pfn(vma, address, pfn);\n"
    "#else\n"
    "    return follow_pfn(vma, address, pfn);\n"
    "#endif\n"
)
NVIDIA_MARK = "nvmedirect setup: follow_pfn() was removed in Linux 6.12"
NVIDIA_PATCHED = (
    "#if defined(NV_UNSAFE_FOLLOW_PFN_PRESENT)\n"
    "    return unsafe_follow_pfn(vma, address, pfn);\n"
    "#else\n"
    f"    /* {NVIDIA_MARK}; its replacement API. */\n"
    "    struct follow_pfnmap_args args = { .vma = vma, .address = address };\n"
    "    int ret = follow_pfnmap_start(&args);\n"
    "\n"
    "    if (ret)\n"
    "        return ret;\n"
    "    *pfn = args.pfn;\n"
    "    follow_pfnmap_end(&args);\n"
    "    return 0;\n"
    "#endif\n"
)
# Newer drivers fall back to their own page-table walk when follow_pfn() is missing.
NVIDIA_HAS_FALLBACK = re.compile(r"#if defined\(NV_FOLLOW_PFN_PRESENT\)\n\s*return follow_pfn\(vma, address, pfn\);\n"
                                 r"#else\n\s*return nv_follow_flavors\(vma, address, pfn\);")

_RSQRT = {
    name: re.compile(rf"^(extern\s+__DEVICE_FUNCTIONS_DECL__\s+__device_builtin__\s+{ctype}\s+{name}\({ctype} x\))"
                     r"(\s*noexcept\(true\))?;[ \t]*$", re.M)
    for name, ctype in (("rsqrt", "double"), ("rsqrtf", "float"))
}


def version_tuple(text: str | None) -> tuple[int, ...]:
    nums = re.findall(r"\d+", text or "")
    return tuple(int(n) for n in nums[:3])


def kernel_release(view: SystemView) -> str | None:
    return view.read("/proc/sys/kernel/osrelease")


def glibc_version(view: SystemView) -> tuple[int, int] | None:
    text = view.read("/usr/include/features.h") or ""
    major = re.search(r"#\s*define\s+__GLIBC__\s+(\d+)", text)
    minor = re.search(r"#\s*define\s+__GLIBC_MINOR__\s+(\d+)", text)
    return (int(major.group(1)), int(minor.group(1))) if major and minor else None


def _found(view: SystemView, patterns: tuple[str, ...]) -> list[str]:
    seen, out = set(), []
    for pattern in patterns:
        for real in sorted(view.root.glob(pattern)):
            key = real.resolve()
            if key not in seen:  # /usr/local/cuda is usually a link to /usr/local/cuda-X.Y: name the target
                seen.add(key)
                inside = key.is_relative_to(view.root.resolve())
                out.append("/" + str(key.relative_to(view.root.resolve()) if inside else real.relative_to(view.root)))
    return out


def nvidia_mlock_steps(view: SystemView) -> list[Step]:
    files = _found(view, NVIDIA_GLOBS)
    release = kernel_release(view)
    steps = []
    for path in files or [None]:
        step = Step(
            key="patch-nvidia-mlock",
            what=f"patch {path or 'the NVIDIA DKMS os-mlock.c'}: nv_follow_pfn() uses follow_pfnmap_start() "
                 "instead of the removed follow_pfn()",
            why="on Linux 6.12+ the GPU-MMIO path (cudaHostRegisterIoMemory of an NVMe BAR) needs it",
            risk="a wrong kernel-module source breaks the NVIDIA driver build (no display on next boot if the "
                 "old module is gone); the patched module must be signed for Secure Boot",
            undo="`nvmedirect setup --rollback`, then rebuild with dkms; or reinstall the nvidia-dkms package",
            after=[f"dkms build/install for kernel {release or '$(uname -r)'} "
                   "(e.g. `dkms install nvidia/VERSION -k $(uname -r)`), then reboot"],
        )
        steps.append(step)
        if path is None:
            step.status, step.note = SKIPPED, "no NVIDIA DKMS source (/usr/src/nvidia-*) found"
            continue
        if version_tuple(release) < (6, 12):
            step.status, step.note = SKIPPED, f"kernel {release} still has follow_pfn(): not needed"
            continue
        text = view.read_bytes(path).decode(errors="surrogateescape")
        if NVIDIA_MARK in text:
            step.status, step.note = DONE, "already patched"
        elif NVIDIA_HAS_FALLBACK.search(text):
            step.status, step.note = SKIPPED, "this driver version already handles kernels without follow_pfn()"
        elif text.count(NVIDIA_UNPATCHED) == 1:
            new = text.replace(NVIDIA_UNPATCHED, NVIDIA_PATCHED).encode(errors="surrogateescape")
            _changes(view, step, [FileEdit(path, new)])
        else:
            step.status, step.note = REFUSED, (f"{path} does not look like a driver version we know "
                                               "(nv_follow_pfn() differs); not touched")
    return steps


def cuda_math_steps(view: SystemView) -> list[Step]:
    files = _found(view, CUDA_GLOBS)
    glibc = glibc_version(view)
    steps = []
    for path in files or [None]:
        step = Step(
            key="patch-cuda-math",
            what=f"patch {path or 'CUDA crt/math_functions.h'}: declare rsqrt/rsqrtf noexcept(true) like glibc",
            why="with glibc 2.41+ nvcc fails: 'exception specification is incompatible' for rsqrt",
            risk="editing a toolkit header; a CUDA update overwrites it (run setup again)",
            undo="`nvmedirect setup --rollback`, or reinstall the CUDA toolkit package",
        )
        steps.append(step)
        if path is None:
            step.status, step.note = SKIPPED, "no CUDA toolkit header found"
            continue
        if glibc is not None and glibc < (2, 41):
            step.status, step.note = SKIPPED, f"glibc {glibc[0]}.{glibc[1]} does not declare rsqrt: not needed"
            continue
        text = view.read_bytes(path).decode(errors="surrogateescape")
        if "_NV_RSQRT_SPECIFIER" in text:
            step.status, step.note = SKIPPED, "this CUDA version (13.2+) is already compatible"
            continue
        matches = {name: list(rx.finditer(text)) for name, rx in _RSQRT.items()}
        if any(len(found) != 1 for found in matches.values()):
            step.status, step.note = REFUSED, (f"{path} does not declare rsqrt/rsqrtf the way known CUDA "
                                               "versions do; not touched")
            continue
        if all(found[0].group(2) for found in matches.values()):
            step.status, step.note = DONE, "already patched"
            continue
        for rx in _RSQRT.values():
            text = rx.sub(lambda m: f"{m.group(1)} noexcept(true);", text)
        _changes(view, step, [FileEdit(path, text.encode(errors="surrogateescape"))])
    return steps
