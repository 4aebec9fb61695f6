"""Working memory below one layer: memory-centric tiling and offloaded activation checkpoints.

``tiling`` turns one huge linear operator into tiles fetched and released one at a time;
``activations`` keeps only the inputs of chosen blocks for backward, in memory, host memory or
on NVMe, and recomputes the rest.
"""
