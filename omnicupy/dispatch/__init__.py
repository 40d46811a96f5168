"""Dispatch: which kernel runs a call, and how it is launched.

    abi       a kernel's parameter struct, declared once (C++ rendering + packing by name)
    params    the structs of every operation
    arch      the architecture table (capabilities, shared memory, SMs), the one arch-name check,
              the current device's arch (asked once per device)
    specs/    one KernelSpec per (operation, family): checks, shared memory, tiles, struct,
              template, launches; the registry
    variant   Variant: the shared key (name, cache key, shared template values); asks its slot
    tiles     selection between the slots' tiles and families
    schedule  launch order of q tiles (heaviest first)
    plan      Plan: the main launch (variant, grid, block, shared memory, order), every launch, why
    decode_plan  the split-KV decode's packing, split count and launches

Knows kernels and their needs; knows nothing of NVRTC or the cache (that is ``omnicupy.jit``) and
nothing of user arrays (that is ``omnicupy.ops``).
"""
