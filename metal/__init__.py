"""Metal kernel sources for TurboQuant and their loader (see kernels.py)."""
