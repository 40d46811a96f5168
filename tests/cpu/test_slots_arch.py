"""The kernel slots' registry (dispatch/specs), the architecture table and the one check of
architecture names (dispatch/arch.py), and what a plan for a named architecture says. CPU only."""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy.cli.catalogue import arch_list, shipped_variants
from omnicupy.cli.precompile import plan as precompile_plan
from omnicupy.dispatch import arch
from omnicupy.dispatch.specs import SPECS, KernelSpec, spec_for
from omnicupy.errors import OmnicupyError, VariantError
from omnicupy.ops import backward


@pytest.mark.parametrize("key", sorted(SPECS))
def test_every_slot_is_complete_and_keyed_by_itself(key):
    spec = SPECS[key]
    assert isinstance(spec, KernelSpec) and (spec.operation, spec.family) == key
    assert spec.template.endswith(".cu.jinja") and spec.prefix.startswith("omni_") and spec.struct.params


@pytest.mark.parametrize("operation,family", [("forward", "ws"), ("decode", "wgmma"), ("backward", "tma")])
def test_an_unregistered_slot_is_a_variant_error(operation, family):
    with pytest.raises(VariantError, match="no .* kernel for operation"):
        spec_for(operation, family)


@pytest.mark.parametrize("kwargs,problem", [
    (dict(family="sync", overlap=True), "overlap is a wgmma/tma pipeline option"),
    (dict(family="wgmma", pingpong=True, overlap=True, br=64, warps=4), "pingpong is not an option"),
    (dict(family="sync", parts=2), "mma.sync backward option"),
    (dict(family="sync", score_grad="1.0f"), "score_grad is not an option"),
])
def test_a_knob_of_another_slot_is_refused(kwargs, problem):
    base = dict(head_dim=64, dtype="fp16", br=64, bc=64, warps=4, stages=2)
    with pytest.raises(VariantError, match=problem):
        omnicupy.dispatch.variant.Variant(**{**base, **kwargs})


def test_every_shipped_variant_names_its_own_slot():
    for v in shipped_variants(ops=("forward", "backward", "decode")):
        assert v.spec is SPECS[(v.operation, v.family)] and v.template == v.spec.template


@pytest.mark.parametrize("name,mma_sync,wgmma,tma,smem_kb", [
    ("sm_80", True, False, False, 163), ("sm_86", True, False, False, 99), ("sm_87", True, False, False, 163),
    ("sm_89", True, False, False, 99), ("sm_90", True, True, True, 227), ("sm_100", True, False, True, 227),
    ("sm_120", True, False, True, 99),
])
def test_the_architecture_table(name, mma_sync, wgmma, tma, smem_kb):
    c = arch.caps(name)
    assert (c.mma_sync, c.wgmma, c.tma, c.smem_optin) == (mma_sync, wgmma, tma, smem_kb * 1024)
    assert c.sm_count > 0 and arch.check_arch(name) == name


@pytest.mark.parametrize("name,family,target", [
    ("sm_80", "sync", "sm_80"), ("sm_90", "sync", "sm_90"), ("sm_90", "wgmma", "sm_90a"), ("sm_90", "tma", "sm_90a"),
    ("sm_90a", "tma", "sm_90a"), ("sm_100", "sync", "sm_100"), ("sm_100", "tma", None), ("sm_120", "wgmma", None),
    ("sm_86", "tma", None),
])
def test_build_targets_follow_the_table(name, family, target):
    assert arch.build_target(name, family) == target


BAD_ARCHS = ["sm_70", "sm_75", "sm_999", "SM_80", "compute_80", "80", "sm_90A", "sm_80 ", "", "sm80", 80, 90.0]


@pytest.mark.parametrize("bad", BAD_ARCHS)
def test_plan_refuses_an_unknown_arch_by_name(bad):
    q = np.zeros((1, 2, 256, 64), np.float16)
    with pytest.raises(arch.ArchError, match="sm_80, sm_86, sm_87, sm_89, sm_90, sm_100, sm_120"):
        omnicupy.plan(q, q, q, arch=bad)
    with pytest.raises(arch.ArchError):
        backward.plan(q, q, q, arch=bad)


@pytest.mark.parametrize("bad", [b for b in BAD_ARCHS if isinstance(b, str) and b.strip() == b])
def test_precompile_refuses_an_unknown_arch(bad):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="is not supported"):
        arch_list(bad)


def test_arch_error_is_an_omnicupy_error():
    assert issubclass(arch.ArchError, OmnicupyError)


@pytest.mark.parametrize("name", ["sm_100", "sm_120"])
def test_mma_sync_variants_precompile_for_blackwell(name):
    variants = shipped_variants(ops=("forward", "backward", "decode"))
    tasks, skipped = precompile_plan(variants, (name,))
    sync = [v for v in variants if v.family == "sync"]
    assert {v for v, _ in tasks} <= set(sync) and all(a == name for _, a in tasks)
    # every mma.sync variant is either built or skipped for a shared memory the real table refuses
    assert len(tasks) + skipped == len(set(sync))
    assert all(v.smem_bytes <= arch.caps(name).smem_optin for v, _ in tasks)
    if name == "sm_100":
        assert skipped == 0


def test_a_plan_for_sm_90_says_what_an_h100_runs():
    """Without a driver here, a plan for sm_90 is the tma family's (tensor maps are encoded on the
    target) and says what it assumes of the target."""
    q = np.zeros((1, 4, 4096, 128), np.float16)
    p = omnicupy.plan(q, q, q, causal=True, arch="sm_90")
    assert p.variant.family == "tma" and "cuda-bindings" in p.reason and "driver" in p.reason
    assert len(p.launches) == 1 and p.launches[0].entry == p.kernel


def test_decode_plan_has_the_plan_shape():
    q = np.zeros((1, 8, 1, 128), np.float16)
    k = np.zeros((1, 2, 4096, 128), np.float16)
    p = omnicupy.plan(q, k, k, causal=True, arch="sm_90")
    assert p.operation == "decode" and p.kernel == p.split.kernel and p.grid == p.split.grid
    assert [launch.entry for launch in p.launches] == list(p.kernels)
