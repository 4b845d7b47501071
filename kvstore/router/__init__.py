"""``kvstore router``: an OpenAI-compatible HTTP proxy that sends each request to the vLLM
replica whose cache (engine-local, or the kvstore node beside it) holds most of its prompt.

Per request (:mod:`.service`): the prompt's token ids (:mod:`.tokenize`), its chunk keys exactly
as the engines' connector names them (:mod:`.keys`), one query of the cluster index
(:mod:`kvstore.cluster`), a score per replica (:mod:`.scoring`: cached prefix weighted by tier
against the load the router itself sent there), then a streaming pass-through (:mod:`.proxy`).
Metrics: :mod:`.metrics`, on the router's ``/metrics``. :mod:`.launch` builds the router from its
configuration and serves it.

Engine-local holdings (vLLM KV events) slot in as :meth:`.scoring.Scorer.choose`'s ``local``
argument: leading cached chunks per replica url, weighted above every kvstore tier.
"""

from kvstore.router.keys import RouterKeys, parse_namespace
from kvstore.router.launch import build_router, parse_replicas, run_router
from kvstore.router.scoring import TIER_WEIGHTS, Decision, Provisional, Replica, Scorer
from kvstore.router.service import Router

__all__ = [
    "TIER_WEIGHTS",
    "Decision",
    "Provisional",
    "Replica",
    "Router",
    "RouterKeys",
    "Scorer",
    "build_router",
    "parse_namespace",
    "parse_replicas",
    "run_router",
]
