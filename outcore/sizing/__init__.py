"""The paper's analysis, applied before a run: what fits where, and how fast it can go.

``estimate`` holds the memory formulas and ``efficiency`` the bandwidth ones, as pure
functions (no torch, any model size); ``placement`` chooses tiers and budgets for
``Config.auto``; ``probe`` measures this machine's disk, host copy and matmul so the
estimates use real bandwidths.
"""
