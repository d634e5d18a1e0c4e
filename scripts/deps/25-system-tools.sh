#!/usr/bin/env bash
# Tools the system-command VM tests run inside the guest (which chroots into this host's root):
# mkfs.ext4 and mkswap (e2fsprogs, util-linux), LVM (lvm2) and MD RAID (mdadm), to build the
# filesystems, swap and stacked devices that `nvmedirect bind` must refuse; mkfs.xfs, mkfs.btrfs and
# mkfs.vfat so write-gguf's signature detection is tested on real filesystems of each kind.
set -euo pipefail
need=()
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v mkswap >/dev/null || need+=(util-linux)
command -v lvm >/dev/null || need+=(lvm2)
command -v mdadm >/dev/null || need+=(mdadm)
command -v mkfs.xfs >/dev/null || need+=(xfsprogs)
command -v mkfs.btrfs >/dev/null || need+=(btrfs-progs)
command -v mkfs.vfat >/dev/null || need+=(dosfstools)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "missing Debian packages ${need[*]}: run as root or install them" >&2
        exit 1
    fi
    apt-get update -qq
    # No recommends: mdadm would pull in a mail server for its monitor, which the tests never run.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
