"""Engine integrations: how inference engines store and load their KV cache through kvstore.

The folders show the sides. Engine-neutral code sits at this level and in :mod:`.paged`
(cache layouts, block plans, the CPU and CUDA copy pipelines, DMA out of the shared arena, the
store-client protocol and the breaker); each engine has its own folder over it
(:mod:`.vllm`). The engine-neutral part never imports an engine's folder (the layering test
says so).
"""
