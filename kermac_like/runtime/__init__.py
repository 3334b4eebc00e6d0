"""The runtime: how a kernel spec becomes a running kernel.

``specs`` (what an instantiation is; one module per family) -> ``compiler`` (NVRTC,
cubin, cache keys) -> ``cache`` (persistent store) -> ``launcher`` (load, launch on
torch's stream). ``precompile`` compiles ahead of the first call. Nothing here knows
about the ops; ``kermac_like.plan`` decides which spec a call needs.
"""
