"""CPUID templates and per-vCPU topology on synthetic KVM_GET_SUPPORTED_CPUID tables."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from smold.kvm import structs as s
from smold.kvm.cpuid import (
    COMPAT_GLIBC_TUNABLES,
    COMPAT_MASKS,
    CpuTemplate,
    CpuTemplateError,
    build_cpuid,
    resolve_template,
    template_cmdline,
)

ALL = 0xFFFFFFFF
HYPERVISOR = 1 << 31          # leaf 1 ECX
HTT = 1 << 28                 # leaf 1 EDX
# Feature bits the PVM emulator cannot execute (docs/pvm-emulator.md), from the Intel SDM.
L1_ECX_CX16, L1_ECX_XSAVE, L1_ECX_OSXSAVE, L1_ECX_AVX = 13, 26, 27, 28
L1_ECX_SSE3, L1_ECX_SSSE3, L1_ECX_SSE41, L1_ECX_SSE42 = 0, 9, 19, 20
L7_EBX_AVX2, L7_EBX_AVX512F, L7_EBX_FSGSBASE, L7_EBX_SMEP = 5, 16, 0, 7
L7_ECX_PKU = 3


def entry(function: int, index: int = 0, eax: int = ALL, ebx: int = ALL, ecx: int = ALL, edx: int = ALL,
          flags: int = 0) -> s.KvmCpuidEntry2:
    e = s.KvmCpuidEntry2()
    e.function, e.index, e.flags = function, index, flags
    e.eax, e.ebx, e.ecx, e.edx = eax, ebx, ecx, edx
    return e


def supported() -> list[s.KvmCpuidEntry2]:
    """Every register all-ones, so each cleared bit is one the builder chose to clear."""
    sig = s.KVM_CPUID_FLAG_SIGNIFCANT_INDEX
    return [
        entry(0x0, eax=0x1F, ebx=0x756E6547, ecx=0x6C65746E, edx=0x49656E69),
        entry(0x1, ebx=0x000000AB),
        entry(0x4, 0, flags=sig), entry(0x4, 1, flags=sig),
        entry(0x7, 0, flags=sig), entry(0x7, 1, flags=sig), entry(0x7, 2, flags=sig),
        entry(0xB, 0, flags=sig), entry(0xB, 1, flags=sig), entry(0xB, 2, flags=sig),
        entry(0xD, 0, flags=sig), entry(0xD, 1, flags=sig), entry(0xD, 2, flags=sig),
        entry(0x1F, 0, flags=sig), entry(0x1F, 1, flags=sig),
        entry(0x80000001),
    ]


def find(entries: list[s.KvmCpuidEntry2], function: int, index: int = 0) -> s.KvmCpuidEntry2:
    hits = [e for e in entries if e.function == function and e.index == index]
    assert len(hits) == 1, f"leaf {function:#x}.{index}: {len(hits)} entries"
    return hits[0]


def leaves(entries: list[s.KvmCpuidEntry2]) -> list[tuple[int, int]]:
    return [(e.function, e.index) for e in entries]


def bit(value: int, n: int) -> bool:
    return bool(value >> n & 1)


# -- templates ----------------------------------------------------------------------------------------
def test_compat_clears_features_the_emulator_cannot_run() -> None:
    out = build_cpuid(supported(), CpuTemplate.COMPAT, 0, 1)
    l1 = find(out, 0x1)
    for n in (L1_ECX_CX16, L1_ECX_XSAVE, L1_ECX_OSXSAVE, L1_ECX_AVX):
        assert not bit(l1.ecx, n), f"leaf 1 ECX bit {n} still set"
    for n in (L1_ECX_SSE3, L1_ECX_SSSE3, L1_ECX_SSE41, L1_ECX_SSE42):
        assert bit(l1.ecx, n), f"leaf 1 ECX bit {n} cleared needlessly"
    l7 = find(out, 0x7, 0)
    assert not bit(l7.ebx, L7_EBX_AVX2) and not bit(l7.ebx, L7_EBX_AVX512F)
    assert bit(l7.ebx, L7_EBX_FSGSBASE) and bit(l7.ebx, L7_EBX_SMEP)
    assert not bit(l7.ecx, L7_ECX_PKU)


def test_compat_clears_exactly_the_listed_mask_bits() -> None:
    out = build_cpuid(supported(), CpuTemplate.COMPAT, 0, 1)
    for m in COMPAT_MASKS:
        subleaves = [m.subleaf] if m.subleaf is not None else [e.index for e in out if e.function == m.leaf]
        for sub in subleaves:
            value = getattr(find(out, m.leaf, sub), m.reg)
            assert value & m.bits == 0, f"{m.leaf:#x}.{sub} {m.reg}"
    for reg in ("eax", "ebx", "ecx", "edx"):
        cleared = ALL & ~sum(m.bits for m in COMPAT_MASKS if m.leaf == 0x7 and m.subleaf == 0 and m.reg == reg)
        assert getattr(find(out, 0x7, 0), reg) == cleared, reg
    # Subleaves and leaves no mask names are untouched.
    for leaf, sub in [(0x7, 2), (0x80000001, 0)]:
        e = find(out, leaf, sub)
        assert (e.eax, e.ebx, e.ecx, e.edx) == (ALL, ALL, ALL, ALL)
    l71 = find(out, 0x7, 1)
    assert l71.eax == ALL & ~((1 << 4) | (1 << 5)) and l71.ebx == ALL


def test_compat_drops_xsave_leaf_entirely() -> None:
    out = build_cpuid(supported(), CpuTemplate.COMPAT, 0, 1)
    assert not any(e.function == 0xD for e in out)
    assert leaves(out) == [lf for lf in leaves(supported()) if lf[0] != 0xD]   # order kept


def test_host_keeps_features_and_leaves() -> None:
    out = build_cpuid(supported(), CpuTemplate.HOST, 0, 1)
    assert leaves(out) == leaves(supported())
    l1 = find(out, 0x1)
    assert l1.ecx == ALL
    for leaf, sub in [(0x7, 0), (0x7, 1), (0xD, 0), (0xD, 1), (0x80000001, 0)]:
        e = find(out, leaf, sub)
        assert (e.eax, e.ebx, e.ecx, e.edx) == (ALL, ALL, ALL, ALL)


@pytest.mark.parametrize("template", list(CpuTemplate))
def test_vendor_leaf_and_flags_pass_through(template: CpuTemplate) -> None:
    out = build_cpuid(supported(), template, 1, 2)
    l0 = find(out, 0x0)
    assert (l0.eax, l0.ebx, l0.ecx, l0.edx) == (0x1F, 0x756E6547, 0x6C65746E, 0x49656E69)
    assert find(out, 0x7, 1).flags == s.KVM_CPUID_FLAG_SIGNIFCANT_INDEX


@pytest.mark.parametrize("template", list(CpuTemplate))
def test_input_not_mutated_and_output_is_a_copy(template: CpuTemplate) -> None:
    src = supported()
    before = [bytes(e) for e in src]
    out = build_cpuid(src, template, 3, 4)
    assert [bytes(e) for e in src] == before
    assert all(o is not i for o in out for i in src)
    out[0].eax = 0
    assert src[0].eax == 0x1F


# -- leaf 1: APIC id, HTT, hypervisor -----------------------------------------------------------------
@pytest.mark.parametrize("template", list(CpuTemplate))
@pytest.mark.parametrize(("index", "count"), [(0, 1), (0, 2), (1, 2), (5, 8), (63, 64)])
def test_leaf1_topology(template: CpuTemplate, index: int, count: int) -> None:
    l1 = find(build_cpuid(supported(), template, index, count), 0x1)
    assert l1.ebx >> 24 == index                  # initial APIC id
    assert l1.ebx >> 16 & 0xFF == count           # logical processors per package
    assert l1.ebx >> 8 & 0xFF == 8                # CLFLUSH line size / 8 (64 bytes)
    assert l1.ebx & 0xFF == 0xAB                  # brand index kept
    assert bit(l1.ecx, 31), "hypervisor bit"
    assert bit(l1.edx, 28) == (count > 1), "HTT"


def test_hypervisor_bit_set_even_when_host_clears_it() -> None:
    src = [entry(0x1, ecx=0, edx=HTT)]
    l1 = find(build_cpuid(src, CpuTemplate.HOST, 0, 1), 0x1)
    assert l1.ecx == HYPERVISOR
    assert l1.edx == 0                            # HTT cleared for one vCPU


def test_htt_set_for_smp_even_when_host_clears_it() -> None:
    l1 = find(build_cpuid([entry(0x1, edx=0)], CpuTemplate.HOST, 0, 2), 0x1)
    assert l1.edx == HTT


def test_each_vcpu_gets_its_own_apic_id() -> None:
    ids = [find(build_cpuid(supported(), CpuTemplate.COMPAT, i, 4), 0x1).ebx >> 24 for i in range(4)]
    assert ids == [0, 1, 2, 3]


# -- leaves 4, 0xB, 0x1F ------------------------------------------------------------------------------
@pytest.mark.parametrize("count", [1, 2, 4, 7])
def test_leaf4_cores_per_package(count: int) -> None:
    out = build_cpuid(supported(), CpuTemplate.HOST, 0, count)
    for sub in (0, 1):
        eax = find(out, 0x4, sub).eax
        assert eax >> 26 == count - 1
        assert eax & 0x3FFF == 0x3FFF             # cache type/level bits kept from the host


@pytest.mark.parametrize("leaf", [0xB, 0x1F])
@pytest.mark.parametrize(("index", "count", "shift"), [(0, 1, 0), (1, 2, 1), (2, 3, 2), (3, 4, 2),
                                                       (4, 5, 3), (10, 16, 4)])
def test_extended_topology(leaf: int, index: int, count: int, shift: int) -> None:
    out = build_cpuid(supported(), CpuTemplate.COMPAT, index, count)
    smt, core = find(out, leaf, 0), find(out, leaf, 1)
    assert (smt.eax, smt.ebx, smt.ecx) == (0, 1, (1 << 8) | 0)           # SMT level, 1 thread
    assert (core.eax, core.ebx, core.ecx) == (shift, count, (2 << 8) | 1)  # core level
    assert smt.edx == core.edx == index                                  # x2APIC id
    assert smt.edx == find(out, 0x1).ebx >> 24                           # agrees with leaf 1
    if leaf == 0xB:
        invalid = find(out, leaf, 2)
        assert (invalid.eax, invalid.ebx, invalid.ecx & 0xFF00) == (0, 0, 0)   # level type 0: end
        assert invalid.ecx & 0xFF == 2 and invalid.edx == index


def test_empty_table() -> None:
    assert build_cpuid([], CpuTemplate.COMPAT, 0, 1) == []


# -- names and the guest command line -----------------------------------------------------------------
@pytest.mark.parametrize(("name", "pvm", "expected"), [
    ("auto", True, CpuTemplate.COMPAT),
    ("auto", False, CpuTemplate.HOST),
    ("host", True, CpuTemplate.HOST),
    ("host", False, CpuTemplate.HOST),
    ("compat", True, CpuTemplate.COMPAT),
    ("compat", False, CpuTemplate.COMPAT),
])
def test_resolve_template(name: str, pvm: bool, expected: CpuTemplate) -> None:
    assert resolve_template(name, pvm=pvm) is expected


@pytest.mark.parametrize("name", ["", "HOST", "Auto", "t2", "host ", "compatible"])
@pytest.mark.parametrize("pvm", [True, False])
def test_unknown_template_rejected(name: str, pvm: bool) -> None:
    with pytest.raises(CpuTemplateError) as info:
        resolve_template(name, pvm=pvm)
    for choice in ("host", "compat", "auto"):
        assert choice in str(info.value)


def test_parse_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        CpuTemplate.parse("nope")
    assert CpuTemplate.parse("compat") is CpuTemplate.COMPAT


def test_compat_cmdline_hides_xsave_and_cx16() -> None:
    words = template_cmdline(CpuTemplate.COMPAT).split()
    assert "noxsave" in words
    cleared = next(w for w in words if w.startswith("clearcpuid=")).split("=", 1)[1].split(",")
    assert {"141", "151"} <= set(cleared)     # CX16, POPCNT
    assert "smol_cpl0_emulated" in words      # the guest kernel patch's switch
    # clearcpuid numbers are word*32+bit; word 4 is CPUID leaf 1 ECX, so 141 is the CX16 bit the
    # COMPAT mask clears in KVM's table.
    assert 4 * 32 + L1_ECX_CX16 == 141
    leaf1_mask = next(m for m in COMPAT_MASKS if m.leaf == 0x1 and m.reg == "ecx")
    assert bit(leaf1_mask.bits, L1_ECX_CX16) and bit(leaf1_mask.bits, L1_ECX_XSAVE)
    assert len(words) == len(set(words))


def test_host_cmdline_is_empty() -> None:
    assert template_cmdline(CpuTemplate.HOST) == ""


def test_compat_smp_cmdline_adds_nopv_and_the_tsc_rate() -> None:
    one = template_cmdline(CpuTemplate.COMPAT, 2_596_096, cpus=1).split()
    two = template_cmdline(CpuTemplate.COMPAT, 2_596_096, cpus=2).split()
    assert "nopv" not in one and not any(w.startswith("tsc_early_khz=") for w in one)
    assert set(one) < set(two)
    assert "nopv" in two
    assert "tsc_early_khz=2596096" in two
    assert "lpj=25960960" in two          # TSC cycles per jiffy at HZ=100
    assert template_cmdline(CpuTemplate.HOST, 2_596_096, cpus=4) == ""


def test_compat_cmdline_keeps_guest_glibc_off_avx() -> None:
    # docs/pvm-emulator.md item 10: noxsave leaves YMM upper halves unsaved, so guest user space must not
    # use AVX. Linux hands a word with '=' and no dot in its name to /init as an environment variable.
    words = template_cmdline(CpuTemplate.COMPAT, 2_596_096, cpus=2).split()
    assert [w for w in words if w.startswith("GLIBC_TUNABLES=")] == [f"GLIBC_TUNABLES={COMPAT_GLIBC_TUNABLES}"]
    name, value = COMPAT_GLIBC_TUNABLES.split("=", 1)
    assert name == "glibc.cpu.hwcaps" and " " not in value
    assert {"-AVX", "-AVX2", "-AVX512F", "-AVX_Fast_Unaligned_Load"} <= set(value.split(","))
    assert "GLIBC_TUNABLES" not in template_cmdline(CpuTemplate.HOST, 2_596_096, cpus=2)


LD_SO = Path("/lib64/ld-linux-x86-64.so.2")


def test_compat_tunables_take_glibc_off_avx() -> None:
    """What glibc (Debian 12's, as in the default rootfs) makes of the tunable: no AVX anywhere."""
    if not LD_SO.exists():
        pytest.skip("no x86-64 glibc loader here")
    r = subprocess.run([str(LD_SO), "--list-diagnostics"], env={"GLIBC_TUNABLES": COMPAT_GLIBC_TUNABLES},
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip("this glibc has no --list-diagnostics (older than 2.33)")
    diag = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert diag["x86.cpu_features.preferred.AVX_Fast_Unaligned_Load"] == "0x0"   # memmove/memcpy
    leaf1_ecx = int(diag["x86.cpu_features.features[0x0].active[0x2]"], 16)
    leaf7_ebx = int(diag["x86.cpu_features.features[0x1].active[0x1]"], 16)
    assert not bit(leaf1_ecx, 28)                     # AVX
    assert not bit(leaf7_ebx, 5) and not bit(leaf7_ebx, 16)   # AVX2, AVX512F
