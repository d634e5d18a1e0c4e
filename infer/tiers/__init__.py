"""The 3-tier weight cache: placement (plan), budgets, host tiers B and C, the streaming ring that
moves streamed tensors into device slots (GPU) or its CPU simulation, and the plan report."""
