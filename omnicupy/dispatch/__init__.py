"""Dispatch: which kernel runs a call, and how it is launched.

    abi       a kernel's parameter struct, declared once (C++ rendering + packing by name)
    params    the structs of every operation
    arch      what each GPU arch can run; the current device's arch (asked once per device)
    variant   Variant: operation x family x tile x features -> template values and kernel name
    tiles     tuned tile tables and tile selection
    schedule  launch order of q tiles (heaviest first)
    plan      Plan: the selected variant with its grid, block, shared memory and launch order

Knows kernels and their needs; knows nothing of NVRTC or the cache (that is ``omnicupy.jit``) and
nothing of user arrays (that is ``omnicupy.ops``).
"""
