"""NVMe submission/completion queues and command encoding."""
