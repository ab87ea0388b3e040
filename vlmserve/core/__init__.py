"""Engine policy: scheduling and cache accounting, pure Python (no tensors, no devices)."""
