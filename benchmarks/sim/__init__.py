"""A trace-driven simulator of a kvstore fleet: N engines, each beside a kvstore node.

Not part of the installed package; it imports kvstore's own rules so that it follows the
product: the block index and eviction orders (:mod:`kvstore.store.index`,
:mod:`kvstore.store.eviction`), the placement policy (:mod:`kvstore.policy`), the tiers'
footprints, the router's :class:`~kvstore.router.scoring.Scorer` and the cluster index's layout.

* :mod:`.workloads`: the Mooncake trace and generated workloads (``workloads.toml``);
* :mod:`.node`: one node's tiers, eviction, placement, promotion;
* :mod:`.index`: the cluster index, its size and operations;
* :mod:`.simulator`: the event loop (routing, engines, sharing);
* :mod:`.run`: the command line (one run, the sweep);
* :mod:`.validate`: the same workload on three real ``kvstore serve`` nodes and on the simulator.
"""
