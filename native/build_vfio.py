"""cffi build script (API mode) for the VFIO ABI and the native hot-path helpers.

Struct layouts and ioctl numbers come from the system's <linux/vfio.h> at compile time: the
declarations below name only the fields we touch and end in `...;` so the C compiler, not this
file, decides sizes and offsets.
"""

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent

CDEF = r"""
#define VFIO_API_VERSION ...
#define VFIO_TYPE1v2_IOMMU ...
#define VFIO_NOIOMMU_IOMMU ...
#define VFIO_GROUP_FLAGS_VIABLE ...
#define VFIO_GROUP_FLAGS_CONTAINER_SET ...
#define VFIO_DEVICE_FLAGS_PCI ...
#define VFIO_DEVICE_FLAGS_RESET ...
#define VFIO_REGION_INFO_FLAG_READ ...
#define VFIO_REGION_INFO_FLAG_WRITE ...
#define VFIO_REGION_INFO_FLAG_MMAP ...
#define VFIO_DMA_MAP_FLAG_READ ...
#define VFIO_DMA_MAP_FLAG_WRITE ...

static const unsigned long VFIO_GET_API_VERSION;
static const unsigned long VFIO_CHECK_EXTENSION;
static const unsigned long VFIO_SET_IOMMU;
static const unsigned long VFIO_GROUP_GET_STATUS;
static const unsigned long VFIO_GROUP_SET_CONTAINER;
static const unsigned long VFIO_GROUP_UNSET_CONTAINER;
static const unsigned long VFIO_GROUP_GET_DEVICE_FD;
static const unsigned long VFIO_DEVICE_GET_INFO;
static const unsigned long VFIO_DEVICE_GET_REGION_INFO;
static const unsigned long VFIO_DEVICE_RESET;
static const unsigned long VFIO_IOMMU_MAP_DMA;
static const unsigned long VFIO_IOMMU_UNMAP_DMA;

enum {
    VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_BAR1_REGION_INDEX, VFIO_PCI_BAR2_REGION_INDEX,
    VFIO_PCI_BAR3_REGION_INDEX, VFIO_PCI_BAR4_REGION_INDEX, VFIO_PCI_BAR5_REGION_INDEX,
    VFIO_PCI_ROM_REGION_INDEX, VFIO_PCI_CONFIG_REGION_INDEX, ...
};

struct vfio_group_status { uint32_t argsz; uint32_t flags; ...; };
struct vfio_device_info { uint32_t argsz; uint32_t flags; uint32_t num_regions; uint32_t num_irqs; ...; };
struct vfio_region_info {
    uint32_t argsz; uint32_t flags; uint32_t index; uint32_t cap_offset;
    uint64_t size; uint64_t offset; ...;
};
struct vfio_iommu_type1_dma_map {
    uint32_t argsz; uint32_t flags; uint64_t vaddr; uint64_t iova; uint64_t size; ...;
};
struct vfio_iommu_type1_dma_unmap {
    uint32_t argsz; uint32_t flags; uint64_t iova; uint64_t size; ...;
};

enum { VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSI_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_ERR_IRQ_INDEX,
       VFIO_PCI_REQ_IRQ_INDEX, ... };

/* ioctl wrappers: non-variadic so cffi can call them cheaply; -errno on failure. */
int nvd_ioctl_ptr(int fd, unsigned long request, void *arg);
int nvd_ioctl_int(int fd, unsigned long request, unsigned long arg);
/* Interrupts: how many an index offers (VFIO_DEVICE_GET_IRQ_INFO), and one eventfd as the
   trigger of an index's first interrupt (-1 unregisters it; VFIO_DEVICE_SET_IRQS). */
int nvd_irq_count(int fd, unsigned int index);
int nvd_irq_eventfd(int fd, unsigned int index, int eventfd);
"""

SOURCE = r"""
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <linux/vfio.h>

static int nvd_ioctl_ptr(int fd, unsigned long request, void *arg)
{
    int rc = ioctl(fd, request, arg);
    return rc < 0 ? -errno : rc;
}

static int nvd_ioctl_int(int fd, unsigned long request, unsigned long arg)
{
    int rc = ioctl(fd, request, arg);
    return rc < 0 ? -errno : rc;
}

static int nvd_irq_count(int fd, unsigned int index)
{
    struct vfio_irq_info info = { .argsz = sizeof(info), .index = index };
    int rc = ioctl(fd, VFIO_DEVICE_GET_IRQ_INFO, &info);
    return rc < 0 ? -errno : (int)info.count;
}

static int nvd_irq_eventfd(int fd, unsigned int index, int eventfd)
{
    /* struct vfio_irq_set ends in a flexible array: here one int32 eventfd follows the header. */
    uint32_t storage[(sizeof(struct vfio_irq_set) + sizeof(int32_t) + 3) / 4];
    struct vfio_irq_set *set = (struct vfio_irq_set *)storage;
    int32_t data = eventfd;
    set->argsz = sizeof(struct vfio_irq_set) + sizeof(int32_t);
    set->flags = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
    set->index = index;
    set->start = 0;
    set->count = 1;
    memcpy(set->data, &data, sizeof(data));
    int rc = ioctl(fd, VFIO_DEVICE_SET_IRQS, set);
    return rc < 0 ? -errno : rc;
}
"""

# Native hot-path helpers (queue submit/poll, MMIO doorbells) live in native/*.c with their
# declarations in native/*.cdef; each pair is appended to this one extension module.
for cdef_path in sorted(HERE.glob("*.cdef")):
    CDEF += "\n" + cdef_path.read_text()
    SOURCE += "\n" + (HERE / (cdef_path.stem + ".c")).read_text()

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
# include_dirs: native/nvme_queue.c includes native/nvme_sqe.h, the SQE/PRP builder it shares with
# the GPU kernels and the controller emulator.
ffibuilder.set_source("nvmedirect._vfio_cffi", SOURCE, include_dirs=[str(HERE)], extra_compile_args=["-O2"],
                      depends=[str(HERE / "nvme_sqe.h")])

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(HERE.parent), verbose=True)
