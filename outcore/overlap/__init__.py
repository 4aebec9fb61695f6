"""Overlap: data movement runs ahead of compute instead of in its way.

``hooks`` are the public PyTorch hooks that fetch a module's groups before it runs and release
them after; ``schedule`` traces the order groups are used in and prefetches along it within one
byte budget.
"""
