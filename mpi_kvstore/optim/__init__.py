"""The optimizer inside the store: its updater, which runs a step's batch of keys as MXNet's
aggregated SGD does from groups kept between steps (``batched``), each rank's share of the
optimizer state and its update (``shards``, ZeRO-1 with LAMB's shared norms), and
global-norm clipping (``clipping``).

It may import ``engine``, ``comm`` and the root modules; the store hands it the updater.
"""
