"""What the client and the server agree on, and nothing else.

* :mod:`kvstore.protocol.messages`: gRPC messages to and from the domain types, status mapping;
* :mod:`kvstore.protocol.shm_frames`: the shared-memory socket's frame format, its ops and limits;
* :mod:`kvstore.protocol.shm_messages`: the shared-memory requests' and replies' bodies (one codec
  each, both endpoints use it);
* :mod:`kvstore.protocol.dram_index`: the published dram index (server writes, clients read);
* :mod:`kvstore.protocol.ucx`: UCX conventions (tags, addresses, loading ``ucxx``);
* :mod:`kvstore.protocol.checks`: the rules a request must meet (counts, key and namespace sizes,
  value sizes against capacity), one copy for every server and client;
* :mod:`kvstore.protocol.rates`: measured rates (a tier's reads, an engine's prefill) and the
  ``Stats`` keys that carry a tier's.

Modules here import only the standard library, numpy, grpc, the generated ``_proto`` code,
kvstore's vocabulary (``errors``, ``keys``, ``types``, ``buffers``, ``retention``, ``formats``,
``deprecation``, ...) and its configuration: never a client, the store, a tier or the server
(``tests/test_layering.py`` holds the list).
"""
