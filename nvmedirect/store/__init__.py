"""GGUF models on raw LBAs: the header record, signature checks, targets, writing and listing."""
