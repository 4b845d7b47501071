"""What the tests share, written once (no test module imports another:
``tests/project/test_test_seams.py`` checks it).

Processes and waiting: free loopback ports (:mod:`.ports`), polling a condition with a deadline
(:mod:`.polling`), the one launcher of a real ``kvstore serve`` (:mod:`.serve`) and the
integration tests' factory of them (:mod:`.server_factory`), stopping a process
(:mod:`.stop_process`), the one launcher of a real ``kvstore router`` (:mod:`.router`), real
``redis-server`` processes and a real Redis Cluster (:mod:`.redis_server`, :mod:`.redis_cluster`),
a real Prometheus (:mod:`.prometheus_server`), hosts as network namespaces (:mod:`.netns_hosts`),
TLS certificates made with ``openssl`` (:mod:`.certs`), real ``kvstore serve --ucx-listen``
servers and their UCX clients (:mod:`.ucx_servers`), the guard of the real-vLLM suite
(:mod:`.vllm_guard`), and a stand-in venv for the ``scripts/setup-*.sh`` tests
(:mod:`.setup_scripts`).

What the tests put and read: a store on real tiers in a temporary directory and its blocks
(:mod:`.store_blocks`), cluster nodes, their blocks and what the index says of them
(:mod:`.cluster_nodes`, :mod:`.router_index`), the key schemes a node publishes
(:mod:`.node_schemes`), signed node descriptions (:mod:`.index_records`), forged blocks and a
rogue peer (:mod:`.block_forgery`, :mod:`.rogue_peer`), rotted LMDB files (:mod:`.lmdb_rot`), an
engine that answers the router (:mod:`.fake_engine`), the fuzzers' request makers
(:mod:`.fuzz_grpc`, :mod:`.fuzz_shm`), the kernels' cases (:mod:`.kernel_cases`,
:mod:`.interp_cases`), the shared-memory, tenant and retention tests' blocks and configs
(:mod:`.shm_blocks`, :mod:`.tenant_config`, :mod:`.retention_blocks`).

Stand-ins, each saying so: the base of the connector tests' store stand-ins
(:mod:`.store_stand_in`), vLLM's scheduler objects (:mod:`.vllm_scheduler`, the one copy), the
connector logic tests' store, configs and connector halves (:mod:`.connector_sides`), a CUDA
device over CPU tensors (:mod:`.cuda_stand_in`), the engine around the connector's real halves
(:mod:`.gpu_harness`), SGLang's host pools and CPU stand-ins (:mod:`.sglang_pool_stand_in`,
:mod:`.sglang_cpu`).

The engines' suites: vLLM's API server, fleet, P/D servers, the README's server command, engine
runs and their configuration (:mod:`.vllm_api_server`, :mod:`.vllm_fleet`,
:mod:`.vllm_pd_servers`, :mod:`.vllm_readme_server`, :mod:`.vllm_engine_runs`,
:mod:`.vllm_engine_config`), the tiny models (:mod:`.tiny_model`, :mod:`.tiny_families`);
SGLang's contract parts and servers (:mod:`.sglang_contract`, :mod:`.sglang_server`, guarded by
:mod:`.sglang_guard`). The scripts the tests run by path (``tests/gpu_harness.py``,
``tests/vllm_engine/engine_runner.py``, ...) are thin: their code is here.

The in-memory store that answers a real client through :class:`kvstore.MockTransport` is
shipped, for users' tests as for ours: :mod:`kvstore.testing` (:mod:`.memory_store` re-exports
it for the modules that still import it from here).

Importable as ``harness`` because ``pyproject.toml`` puts ``tests/`` on pytest's path.
"""
