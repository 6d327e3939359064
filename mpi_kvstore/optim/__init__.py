"""The optimizer inside the store: each rank's share of the optimizer state and its update
(``shards``, ZeRO-1 with LAMB's shared norms), and global-norm clipping (``clipping``).

It may import ``engine``, ``comm`` and the root modules; the store hands it the updater.
"""
