"""What the tests share, written once (no test module imports another:
``tests/project/test_test_seams.py`` checks it).

Processes and waiting: free loopback ports (:mod:`.ports`), polling a condition with a deadline
(:mod:`.polling`), the one launcher of a real ``kvstore serve`` (:mod:`.serve`) and the
integration tests' factory of them (:mod:`.server_factory`), stopping a process
(:mod:`.stop_process`), the one launcher of a real ``kvstore router`` (:mod:`.router`), real
``redis-server`` processes and a real Redis Cluster (:mod:`.redis_server`, :mod:`.redis_cluster`),
a real Prometheus (:mod:`.prometheus_server`), hosts as network namespaces (:mod:`.netns_hosts`),
TLS certificates made with ``openssl`` (:mod:`.certs`), the guard of the real-vLLM suite
(:mod:`.vllm_guard`), and a stand-in venv for the ``scripts/setup-*.sh`` tests
(:mod:`.setup_scripts`).

What the tests put and read: a store on real tiers in a temporary directory and its blocks
(:mod:`.store_blocks`), cluster nodes, their blocks and what the index says of them
(:mod:`.cluster_nodes`, :mod:`.router_index`), the key schemes a node publishes
(:mod:`.node_schemes`), signed node descriptions (:mod:`.index_records`), forged blocks and a
rogue peer (:mod:`.block_forgery`, :mod:`.rogue_peer`), rotted LMDB files (:mod:`.lmdb_rot`), an
engine that answers the router (:mod:`.fake_engine`), the fuzzers' request makers
(:mod:`.fuzz_grpc`, :mod:`.fuzz_shm`), the kernels' cases (:mod:`.kernel_cases`,
:mod:`.interp_cases`) and the base of the connector tests' store stand-ins (:mod:`.store_stand_in`).

The in-memory store that answers a real client through :class:`kvstore.MockTransport` is
shipped, for users' tests as for ours: :mod:`kvstore.testing` (:mod:`.memory_store` re-exports
it for the modules that still import it from here).

Importable as ``harness`` because ``pyproject.toml`` puts ``tests/`` on pytest's path.
"""
