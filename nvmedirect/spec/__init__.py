"""What the NVMe base specification fixes, with no behaviour: register offsets and bits, opcodes,
queue entry and Identify layouts (`layout`), and the completion status table (`status`). The queue,
controller and namespace layers all build on it, so it imports nothing of theirs."""
