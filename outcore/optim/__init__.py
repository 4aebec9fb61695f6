"""The optimizer over this rank's fp32 shards, wherever they live.

``optimizer`` is the sharded AdamW step, streamed in sub-groups from host memory or NVMe with
reads, update and write-back overlapped; ``work`` is the book-keeping of the units in flight;
``precision`` is fp16's dynamic loss scaling.
"""
