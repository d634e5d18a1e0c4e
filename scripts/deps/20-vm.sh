#!/usr/bin/env bash
# VM test assets: the Debian kernel, an initramfs and VFIO modules rebuilt with no-IOMMU support,
# cached under ${NVMEDIRECT_CACHE:-~/.cache/nvmedirect}/vm/<kernel-version>/ (scripts/vm/build_assets.py).
# Seconds when the cache is current; about half a minute to build. Needs 10-debian.sh's packages.
set -euo pipefail
cd "$(dirname "$0")/../.."
builder=scripts/vm/build_assets.py

if python3 "$builder" --check 2>/dev/null; then
    exit 0
fi

# The module build needs a compiler and make; the kernel's kbuild tools need libelf.
need=()
command -v gcc-12 >/dev/null || need+=(gcc-12)
command -v make >/dev/null || need+=(make)
[ -e /usr/include/stdio.h ] || need+=(libc6-dev)
command -v xz >/dev/null || need+=(xz-utils)
ldconfig -p | grep -q 'libelf\.so\.1' || need+=(libelf1)
if [ "$(id -u)" = 0 ]; then
    # Fresh package lists: the kernel version `linux-image-amd64` names, and the exact versions
    # `apt-get download` fetches, must be the archive's current ones.
    apt-get update -qq
    if [ ${#need[@]} -gt 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
elif [ ${#need[@]} -gt 0 ]; then
    echo "20-vm: missing Debian packages ${need[*]}: run as root or install them" >&2
    exit 1
fi
python3 "$builder"
