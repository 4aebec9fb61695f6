"""ZeRO stage 3: every rank holds 1/W of each parameter, and full weights exist only in use.

``sharding`` is the partition math; ``param`` is one parameter and its shard (FSDP2's
per-parameter lifetime), ``group`` the parameters gathered and reduced together, ``registry``
the map from ``nn.Parameter`` to its shard; ``comm`` the collectives; ``init`` shards a model as
it is built; ``gathered`` gives users full parameters for a moment.
"""
