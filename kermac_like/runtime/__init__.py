"""The runtime: how a kernel spec becomes a running kernel.

``specs`` (what an instantiation is; one module per family) -> ``compiler`` (NVRTC,
cubin, cache keys) -> ``cache`` (persistent store, warm reader, bundles) -> ``store`` (the
kernel store: the one lookup order, process cache to compile, and background compiles) ->
``loader`` (cubin -> kernel on a device) -> ``launcher`` (launch on torch's stream).
``precompile`` compiles ahead of the first call. Nothing here knows about the ops;
``kermac_like.plan`` decides which spec a call needs (and autotunes the choice).
"""
