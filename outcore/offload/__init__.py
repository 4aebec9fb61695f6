"""The offload engine: where shard bytes live, and how they move between tiers.

``storage`` gives every shard a home tier (``StoredShard``) and keeps the per-tier byte ledger;
``buffers`` is the fixed pool of aligned (page-locked on CUDA) host buffers; ``aio`` moves bytes
between those buffers and files on a thread pool and returns futures; ``nvme`` is the per-rank
swap file cut into extents; ``host_memory`` keeps glibc from holding freed shards; ``stale``
removes swap folders of killed runs.
"""
