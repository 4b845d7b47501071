"""What the tests share, written once: free loopback ports (:mod:`.ports`), polling a condition
with a deadline (:mod:`.polling`), the one launcher of a real ``kvstore serve`` (:mod:`.serve`),
stopping a server (:mod:`.stop_process`), real ``redis-server`` processes and a real Redis Cluster
(:mod:`.redis_server`, :mod:`.redis_cluster`), the key schemes a node publishes in the cluster
index (:mod:`.node_schemes`), and the guard of the real-vLLM suite
(:mod:`.vllm_guard`).

The in-memory store that answers a real client through :class:`kvstore.MockTransport` is
shipped, for users' tests as for ours: :mod:`kvstore.testing`.

Importable as ``harness`` because ``pyproject.toml`` puts ``tests/`` on pytest's path.
"""
