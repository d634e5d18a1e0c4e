#!/bin/busybox sh
# PID 1 of the test VM (packed into the initramfs by scripts/vm/build_assets.py).
#
# Loads the modules the tests need, mounts the host's root read-only over 9p and a writable 9p share
# for results, chroots into the host root and runs the job the host wrote into the share. The job's
# exit code leaves through QEMU's isa-debug-exit port (QEMU then exits with 2*rc+1), so the host
# learns it without parsing the console.
#
# Kernel command line, read here:
#   nvd.mode=iommu|noiommu   which VFIO build to load (no-IOMMU needs our rebuilt modules)
#   nvd.nctrl=N              wait until N NVMe controllers are probed before starting the job
#   nvd.debug=1              shell trace of this script on the console

/bin/busybox mkdir -p /bin /proc /sys /dev /newroot
/bin/busybox --install -s /bin
export PATH=/bin

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

RESULTS=/newroot/run/vm/results
DEBUG_EXIT_PORT=244  # 0xf4, the iobase QEMU's isa-debug-exit device is given by tests/vm/rig.py

# Guest uptime on every line: the boot's phases can be timed from the console alone.
say() { echo "nvd-init [$(cut -d' ' -f1 /proc/uptime)s]: $*"; }

# Writes one byte to the debug-exit port; QEMU exits at once with 2*byte+1.
report_and_exit() {
    sync
    printf "\\$(printf %o "$1")" | dd of=/dev/port bs=1 seek=$DEBUG_EXIT_PORT count=1 conv=notrunc 2>/dev/null
    say "debug-exit port did not stop QEMU; powering off"
    poweroff -f
}

# A failure of the rig itself, before the job ran: the host sees 255 and no job-started marker.
fail() {
    say "FAILED: $*"
    report_and_exit 255
}

mode=iommu
nctrl=0
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        nvd.mode=*) mode="${arg#*=}" ;;
        nvd.nctrl=*) nctrl="${arg#*=}" ;;
        nvd.debug=1) set -x ;;
    esac
done

# Each list holds module paths in dependency order (computed on the host with modprobe --show-depends).
# A module that fails to load is reported; the mounts and checks below decide whether that matters.
load_list() {
    list="$1"
    shift
    [ -f "$list" ] || fail "module list $list missing from the initramfs"
    while read -r ko; do
        [ -n "$ko" ] || continue
        params=""
        case "$ko" in */vfio.ko) params="$*" ;; esac
        # shellcheck disable=SC2086  # params are separate words on purpose
        out=$(insmod "/modules/$ko" $params 2>&1) || case "$out" in
            *"File exists"*) ;;
            *) say "insmod $ko: $out" ;;
        esac
    done < "$list"
}

load_list /modules/base.list
case "$mode" in
    iommu) load_list /modules/vfio-iommu.list ;;
    noiommu) load_list /modules/vfio-noiommu.list enable_unsafe_noiommu_mode=1 ;;
    *) fail "unknown nvd.mode=$mode (iommu or noiommu)" ;;
esac
load_list /modules/extra.list
say "modules loaded"

mount -t 9p -o ro,trans=virtio,version=9p2000.L,msize=512000,cache=loose hostroot /newroot \
    || fail "cannot mount the host root over 9p (tag hostroot)"
# Everything the guest may write lives in its own memory; the host's /run, /tmp and /dev stay out of reach.
mount -t proc proc /newroot/proc || fail "mount /proc"
mount -t sysfs sysfs /newroot/sys || fail "mount /sys"
mount -t devtmpfs devtmpfs /newroot/dev || fail "mount /dev"
mkdir -p /newroot/dev/pts /newroot/dev/shm /newroot/dev/hugepages
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs tmpfs /newroot/dev/shm
mount -t hugetlbfs hugetlbfs /newroot/dev/hugepages
mount -t tmpfs -o mode=755 tmpfs /newroot/run || fail "mount /run"
# /tmp and /var/tmp: the host's files stay visible (tests pass images and data through pytest's
# tmp_path) while the guest's writes go to an overlay upper layer in guest memory.
mkdir -p /overlay
mount -t tmpfs -o mode=755 tmpfs /overlay
for dir in tmp var/tmp; do
    [ -d "/newroot/$dir" ] || continue
    layer="/overlay/$(echo "$dir" | tr / -)"
    mkdir -p "$layer/upper" "$layer/work"
    chmod 1777 "$layer/upper"
    mount -t overlay overlay -o "lowerdir=/newroot/$dir,upperdir=$layer/upper,workdir=$layer/work" \
        "/newroot/$dir" || {
        say "overlay on /$dir failed; the guest gets an empty tmpfs there instead"
        mount -t tmpfs -o mode=1777 tmpfs "/newroot/$dir" || fail "mount /$dir"
    }
done
mkdir -p "$RESULTS"
# No cache option here: the host writes into this share while the guest runs (QMP replies).
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 results "$RESULTS" \
    || fail "cannot mount the results share over 9p (tag results)"
[ -f "$RESULTS/job.sh" ] || fail "the host wrote no job.sh into the results share"

# The kernel probes NVMe controllers asynchronously; the job starts once all of them have a serial.
waited=0
while :; do
    found=0
    for c in /sys/class/nvme/nvme*; do
        [ -s "$c/serial" ] && found=$((found + 1))
    done
    [ "$found" -ge "$nctrl" ] && break
    [ "$waited" -ge 300 ] && fail "only $found of $nctrl NVMe controllers appeared within 30 s"
    sleep 0.1
    waited=$((waited + 1))
done

# serial -> PCI address, controller name, namespaces: what guest tests use to find their device.
{
    echo "{"
    sep=""
    for c in /sys/class/nvme/nvme*; do
        [ -s "$c/serial" ] || continue
        name="${c##*/}"
        serial=$(cat "$c/serial")
        serial="${serial%"${serial##*[! ]}"}"
        model=$(cat "$c/model")
        model="${model%"${model##*[! ]}"}"
        namespaces=""
        for n in "$c"/"$name"n*; do
            [ -e "$n" ] && namespaces="$namespaces${namespaces:+, }\"${n##*/}\""
        done
        printf '%s  "%s": {"bdf": "%s", "controller": "%s", "model": "%s", "namespaces": [%s]}' \
            "$sep" "$serial" "$(cat "$c/address")" "$name" "$model" "$namespaces"
        sep=",
"
    done
    echo
    echo "}"
} > "$RESULTS/controllers.json"

echo "$mode" > "$RESULTS/job-started"
say "starting job ($mode, $found NVMe controllers)"
chroot /newroot /bin/sh /run/vm/results/job.sh
rc=$?
say "job exited with $rc"
echo "$rc" > "$RESULTS/job-exit-code"
umount "$RESULTS"
report_and_exit "$rc"
