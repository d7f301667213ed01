"""The KVM rig's pure parts (scripts/kvm_rig.py): apt output parsing, the job's environment, arguments, QEMU argv."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import kvm_rig  # noqa: E402

DEPENDS = """linux-image-amd64
  Depends: linux-image-6.1.0-57-amd64
"""
SHOW = """Package: linux-image-6.1.0-57-amd64
Version: 6.1.190-1
SHA256: aaaa
Description: old

Package: linux-image-6.1.0-57-amd64
Version: 6.1.192-3
SHA256: bbbb
Description: Linux 6.1
 SHA256: not-a-field (a continuation line)
"""
POLICY = """linux-image-6.1.0-57-amd64:
  Installed: (none)
  Candidate: 6.1.192-3
"""


def test_apt_parsing() -> None:
    assert kvm_rig.parse_depends(DEPENDS) == "linux-image-6.1.0-57-amd64"
    assert kvm_rig.candidate_version(POLICY) == "6.1.192-3"
    assert kvm_rig.parse_show(SHOW, "6.1.192-3") == "bbbb"
    assert kvm_rig.parse_show(SHOW, "6.1.190-1") == "aaaa"
    with pytest.raises(kvm_rig.RigError, match="no SHA256"):
        kvm_rig.parse_show(SHOW, "9.9")
    with pytest.raises(kvm_rig.RigError, match="apt-get update"):
        kvm_rig.parse_depends("linux-image-amd64\n")
    with pytest.raises(kvm_rig.RigError, match="candidate"):
        kvm_rig.candidate_version("x:\n  Candidate: (none)\n")


def test_job_env_passes_ci_and_the_projects_variables_only() -> None:
    env = kvm_rig.job_env(["A=b=c"], {"CI": "true", "SMOL_X": "1", "PYTEST_ADDOPTS": "-x", "HOME": "/root",
                                      "SSH_AUTH_SOCK": "/tmp/s", "AWS_SECRET_ACCESS_KEY": "k"})
    assert env == {"CI": "true", "SMOL_X": "1", "PYTEST_ADDOPTS": "-x", "A": "b=c", "SMOL_KVM_RIG": "1"}
    with pytest.raises(kvm_rig.RigError, match="NAME=VALUE"):
        kvm_rig.job_env(["novalue"], {})


def test_arguments() -> None:
    args = kvm_rig.parse_args(["--cpus", "2", "--", "pytest", "-q", "--x"])
    assert args.command == ["pytest", "-q", "--x"] and args.cpus == 2
    with pytest.raises(SystemExit):
        kvm_rig.parse_args(["--cpus", "2"])


def test_qemu_shares_the_host_root_read_only_and_has_no_network(tmp_path: Path) -> None:
    tree = kvm_rig.KernelTree("6.1.0-57-amd64", tmp_path / "vmlinuz", tmp_path / "modules")
    argv = kvm_rig.qemu_argv("qemu", tree, tmp_path / "initrd", tmp_path / "job", 2, 4096)
    joined = " ".join(argv)
    assert "-accel tcg,thread=multi" in joined and "-cpu max" in joined and "-smp 2" in joined
    assert "path=/,security_model=none,readonly=on" in joined
    assert f"path={tmp_path / 'job'},security_model=none" in joined
    assert argv[argv.index("-nic") + 1] == "none"
    assert "-no-reboot" in argv


def test_find_tree_picks_a_kernel_with_kvm_modules(tmp_path: Path) -> None:
    assert kvm_rig.find_tree(tmp_path) is None
    (tmp_path / "boot").mkdir()
    (tmp_path / "boot" / "vmlinuz-1.0-amd64").write_bytes(b"k")
    (tmp_path / "boot" / "vmlinuz-0.9-amd64").write_bytes(b"k")
    assert kvm_rig.find_tree(tmp_path) is None                  # no module tree with KVM
    (tmp_path / "lib/modules/1.0-amd64/kernel/arch/x86/kvm").mkdir(parents=True)
    tree = kvm_rig.find_tree(tmp_path)
    assert tree is not None and tree.version == "1.0-amd64"
    with pytest.raises(kvm_rig.RigError, match="modules.dep"):
        tree.check()


def test_qemu_version_from_its_banner_or_zero(tmp_path: Path) -> None:
    fake = tmp_path / "qemu"
    fake.write_text("#!/bin/sh\necho 'QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)'\n")
    fake.chmod(0o755)
    assert kvm_rig.qemu_version(str(fake)) == (10, 0, 2)
    fake.write_text("#!/bin/sh\necho 'something else'\n")
    assert kvm_rig.qemu_version(str(fake)) == (0,)
    assert kvm_rig.qemu_version(str(tmp_path / "missing")) == (0,)
    assert (7, 2) < (10, 0) <= (10, 0, 2)     # how prepare() compares them


def test_candidate_options_reach_qemu_and_the_module_load(tmp_path: Path) -> None:
    """--cpu-model and --kvm-amd (docs/kvm-rig.md, "Candidates measured"); anything shell-like is refused."""
    tree = kvm_rig.KernelTree("6.1.0-57-amd64", tmp_path / "vmlinuz", tmp_path / "modules")
    argv = kvm_rig.qemu_argv("qemu", tree, tmp_path / "initrd", tmp_path / "job", 2, 4096, cpu_model="EPYC-v4")
    assert argv[argv.index("-cpu") + 1] == "EPYC-v4"
    args = kvm_rig.parse_args(["--kvm-amd", "vgif=0", "--kvm-amd", "avic=1", "--cpu-model", "EPYC-v4", "--", "true"])
    assert (args.kvm_amd, args.cpu_model) == (["vgif=0", "avic=1"], "EPYC-v4")
    assert kvm_rig.parse_args(["--", "true"]).cpu_model == "max"
    assert kvm_rig.parse_args(["--", "true"]).tcg_thread == "multi"
    single = kvm_rig.qemu_argv("qemu", tree, tmp_path / "initrd", tmp_path / "job", 2, 4096, tcg_thread="single")
    assert single[single.index("-accel") + 1] == "tcg,thread=single"
    small = kvm_rig.qemu_argv("qemu", tree, tmp_path / "initrd", tmp_path / "job", 2, 4096, tb_size_mib=32)
    assert small[small.index("-accel") + 1] == "tcg,thread=multi,tb-size=32"
    assert kvm_rig.parse_args(["--tb-size", "32", "--", "true"]).tb_size == 32
    assert kvm_rig.parse_args(["--", "true"]).tb_size == 0
    for bad in (["--kvm-amd", "vgif=0; reboot"], ["--kvm-amd", "vgif"], ["--cpu-model", "max $(x)"]):
        with pytest.raises(SystemExit):
            kvm_rig.parse_args([*bad, "--", "true"])


def test_qemu_label_names_the_rig_builds_fixes() -> None:
    debian = "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-1~bpo12+1)\n"
    ours = "QEMU emulator version 10.0.13 (smol rig: SVM EVENTINJ fix, NPT guards)\nCopyright (c) 2003-2025\n"
    assert kvm_rig.qemu_label((10, 0, 2), debian) == "10.0.2"
    assert kvm_rig.qemu_label((10, 0, 13), ours) == "10.0.13 with SVM EVENTINJ fix, NPT guards"


def test_guard_reports_are_the_patched_qemus_lines_only() -> None:
    log = ("qemu-system-x86_64: warning: host doesn't support requested feature\n"
           "smol-rig-qemu: cpu 1: NPT set in host mode: host access translated without it (hflags 0x1)\n"
           + "smol-rig-qemu: cpu 0: #VMEXIT in host mode: guest state not saved\n" * 50)
    got = kvm_rig.guard_reports(log)
    assert got[0] == "smol-rig-qemu: cpu 1: NPT set in host mode: host access translated without it (hflags 0x1)"
    assert len(got) == 40 and all(line.startswith("smol-rig-qemu:") for line in got)
    assert kvm_rig.guard_reports("nothing here\n") == []
