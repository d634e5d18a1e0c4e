"""The GPU-initiated NVMe path: kernels that build SQEs and ring doorbells, their rings, the BAR0 probe."""
