"""Engine-neutral paged-cache machinery: layouts, block plans, host copies, the device pipelines.

Nothing here imports an engine: an engine's integration (:mod:`kvstore.integrations.vllm`)
describes its cache in these terms and drives these pipelines.
"""
