"""The KVM rig: run a command on real (nested) hardware KVM inside a QEMU TCG machine, then power it off.

Why: this project's development and CI hosts expose PVM as ``/dev/kvm`` (an instruction emulator for guest
kernels, docs/pvm-emulator.md), which never exercises the path real users run on: VMX/SVM, the ``host`` CPU
template, SMP, kvm-clock. QEMU's TCG emulates an AMD CPU with SVM and nested paging; Debian's own kernel
(``linux-image-amd64``) loads ``kvm_amd`` inside it and offers a real ``/dev/kvm``. docs/kvm-rig.md says
what it costs and what it does not cover.

How (all of it plain Debian packages: qemu-system-x86, linux-image-amd64, busybox-static, kmod):
- the rig's kernel is Debian's ``linux-image-amd64`` kernel package, downloaded with apt and unpacked under
  ``~/.cache/smol/rig-kernel-<sha256 of the .deb>`` (the host's own /boot is never touched);
- its root file system is this host's ``/``, shared read-only over virtio-9p, under a tmpfs overlay: the
  project, its virtual environment, the guest artifacts and every tool (and /tmp) are at the same paths, with no
  disk image to build or copy; writes stay inside the rig's memory and vanish with it;
- a tiny initramfs (static busybox and the 9p/virtio/overlay modules, cached by content hash) mounts that
  and hands over to stage two (``RIG_INIT`` below, bash from the host's tree), which mounts a unified
  cgroup v2 hierarchy, loads ``kvm_amd``, runs the command in the given directory with the given
  environment, copies back the files it was asked for, and powers off;
- a second 9p share (a temp directory on the host) carries the command in, and its output, exit status,
  heartbeat and files out. The output is streamed to our stdout as it grows.

Robustness: QEMU runs in a process group of its own; on exit, timeout, Ctrl-C or SIGTERM it is killed and the
temp directory removed. A watchdog fails the run with the rig's console tail when stage two's heartbeat
(written every 5 s) stops for ``--hang-timeout`` seconds (seen once: a rig spinning at 200% CPU with no
console output), or when stage two never starts within ``--boot-timeout``.

Exit status: the command's; 124 when ``--timeout`` ran out; 125 when the rig itself failed (no QEMU, the
kernel package, kvm_amd refusing to load, a hang, no exit status written); 130/143 when interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import lzma
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from smold.images.cache import default_cache_root  # noqa: E402  (stdlib only: runs without the venv)

EXIT_TIMEOUT = 124
EXIT_RIG = 125
KERNEL_META = "linux-image-amd64"
# Modules the initramfs loads (with their dependencies, in modprobe's order) to mount the 9p root.
INITRAMFS_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")
MSIZE = 512 * 1024
# Environment variables handed to the command unless --env says otherwise: CI's marker and the project's own.
PASSED_ENV_PREFIXES = ("SMOL_", "PYTEST_")
PASSED_ENV_NAMES = ("CI", "TERM", "LANG", "LC_ALL", "TZ", "HYPOTHESIS_PROFILE")


class RigError(Exception):
    """The rig could not be built, booted or run (as opposed to the command failing inside it)."""


def log(msg: str) -> None:
    print(f"kvm-rig: {msg}", file=sys.stderr, flush=True)


def run_quiet(argv: list[str], **kw: object) -> str:
    """Run a helper; its stdout, or RigError with its stderr."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]
    except FileNotFoundError as e:
        raise RigError(f"{argv[0]} is not installed: {e}") from e
    if proc.returncode != 0:
        raise RigError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return str(proc.stdout)


# --------------------------------------------------------------------------------------------------------
# The rig's kernel: Debian's linux-image-amd64, unpacked into the cache by the .deb's SHA256
# --------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class KernelTree:
    """A kernel image and the module tree that goes with it."""
    version: str
    vmlinuz: Path
    modules: Path            # .../lib/modules/<version>, depmod run

    def check(self) -> None:
        for p in (self.vmlinuz, self.modules / "modules.dep", self.modules / "kernel/arch/x86/kvm"):
            if not p.exists():
                raise RigError(f"the rig kernel tree lacks {p}")


def parse_depends(text: str, meta: str = KERNEL_META) -> str:
    """The concrete kernel package from ``apt-cache depends <meta>`` output."""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Depends: linux-image-"):
            return line.split(":", 1)[1].strip()
    raise RigError(f"apt-cache depends {meta} names no linux-image package (run apt-get update?)")


def parse_show(text: str, version: str) -> str:
    """The SHA256 of ``version`` in ``apt-cache show`` output (several stanzas, one per version)."""
    for stanza in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " ")
        if fields.get("Version") == version and fields.get("SHA256"):
            return fields["SHA256"]
    raise RigError(f"apt-cache show lists no SHA256 for version {version}")


def candidate_version(policy: str) -> str:
    for line in policy.splitlines():
        if line.strip().startswith("Candidate:"):
            v = line.split(":", 1)[1].strip()
            if v and v != "(none)":
                return v
    raise RigError("apt-cache policy gives no candidate version for the rig kernel (run apt-get update?)")


def kernel_from_apt(cache: Path) -> KernelTree:
    """Download (once) and unpack the kernel package ``linux-image-amd64`` depends on."""
    pkg = parse_depends(run_quiet(["apt-cache", "depends", KERNEL_META]))
    version = candidate_version(run_quiet(["apt-cache", "policy", pkg]))
    sha = parse_show(run_quiet(["apt-cache", "show", pkg]), version)
    dest = cache / f"rig-kernel-{sha[:16]}"
    tree = find_tree(dest / "root")
    if tree is not None and (dest / "ok").exists():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".rig-kernel-", dir=cache))
    try:
        log(f"downloading {pkg} {version} for the rig")
        run_quiet(["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", f"{pkg}={version}"], cwd=work)
        debs = list(work.glob("*.deb"))
        if len(debs) != 1:
            raise RigError(f"apt-get download left {len(debs)} .deb files")
        got = hashlib.sha256(debs[0].read_bytes()).hexdigest()
        if got != sha:
            raise RigError(f"{debs[0].name}: sha256 {got}, apt says {sha}")
        run_quiet(["dpkg-deb", "-x", str(debs[0]), str(work / "root")])
        tree = find_tree(work / "root")
        if tree is None:
            raise RigError(f"{pkg} holds no /boot/vmlinuz-* with a module tree")
        run_quiet(["depmod", "-b", str(work / "root"), tree.version])
        debs[0].unlink()
        (work / "ok").write_text(f"{pkg} {version} {sha}\n")
        shutil.rmtree(dest, ignore_errors=True)
        work.rename(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tree = find_tree(dest / "root")
    assert tree is not None
    return tree


def find_tree(root: Path) -> KernelTree | None:
    """The newest ``boot/vmlinuz-V`` under ``root`` whose ``lib/modules/V`` has KVM in it."""
    found = []
    for vmlinuz in (root / "boot").glob("vmlinuz-*"):
        version = vmlinuz.name[len("vmlinuz-"):]
        modules = root / "lib/modules" / version
        if (modules / "kernel/arch/x86/kvm").is_dir():
            found.append(KernelTree(version, vmlinuz, modules))
    found.sort(key=lambda t: t.vmlinuz.stat().st_mtime)
    return found[-1] if found else None


def kernel_tree(args: argparse.Namespace) -> KernelTree:
    if args.kernel_root:
        tree = find_tree(Path(args.kernel_root))
        if tree is None:
            raise RigError(f"--kernel-root {args.kernel_root}: no boot/vmlinuz-V with lib/modules/V/kernel/arch/x86/kvm")
    else:
        tree = kernel_from_apt(default_cache_root())
    tree.check()
    return tree


# --------------------------------------------------------------------------------------------------------
# The initramfs: static busybox, the modules for a 9p root, and stage one of init
# --------------------------------------------------------------------------------------------------------

STAGE1 = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /lower /upper /newroot
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
fail() { echo "kvm-rig stage 1: $*" > /dev/ttyS0; /bin/busybox poweroff -f; }
while read -r m; do /bin/busybox insmod "$m" || fail "insmod $m"; done < /modules.load
/bin/busybox mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=@MSIZE@ hostroot /lower \
    || fail "mounting the host root over 9p"
/bin/busybox mount -t tmpfs -o mode=0755 tmpfs /upper
/bin/busybox mkdir -p /upper/data /upper/work
/bin/busybox mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /newroot \
    || fail "mounting the overlay root"
/bin/busybox mount -t tmpfs -o mode=0755 tmpfs /newroot/run
/bin/busybox mkdir -p /newroot/run/rig
/bin/busybox mount -t 9p -o trans=virtio,version=9p2000.L,cache=none,msize=@MSIZE@ rigjob /newroot/run/rig \
    || fail "mounting the job share"
/bin/busybox umount /proc /sys
/bin/busybox umount /dev
exec /bin/busybox switch_root /newroot /bin/bash /run/rig/init
"""

# Stage two runs from the host's own tree (bash, kmod, util-linux, iproute2). The job directory is mounted
# at /run/rig: init (this), job.json in; output, heartbeat, rc, files/N out.
RIG_INIT = r"""#!/bin/bash
set -u
J=/run/rig
status() { echo "$1" > $J/rc.tmp && mv $J/rc.tmp $J/rc; }
rigfail() { echo "kvm-rig: $*" >> $J/output; echo "$*" > $J/rig-error; sync; echo o > /proc/sysrq-trigger; sleep 60; }
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
# /tmp stays the overlay's: a checkout or file under the host's /tmp is where the command expects it
mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup || rigfail "mounting cgroup v2"
# every controller the kernel offers, for the children of the root
ctl=$(sed 's/[^ ][^ ]*/+&/g' /sys/fs/cgroup/cgroup.controllers)
echo "$ctl" > /sys/fs/cgroup/cgroup.subtree_control || rigfail "enabling cgroup controllers: $ctl"
mount -t debugfs none /sys/kernel/debug 2>/dev/null || true
[ -d "@MODULES@" ] && mkdir -p /lib/modules/@KVER@ && mount --bind "@MODULES@" /lib/modules/@KVER@
hostname smol-rig
ip link set lo up
# the heartbeat, and every 30 s a process list the host shows when the run fails or hangs
( n=0; while :; do date +%s > $J/heartbeat.tmp && mv $J/heartbeat.tmp $J/heartbeat
  [ $((n % 6)) = 0 ] && ps -eo pid,etimes,time,stat,rss,args --forest --cols 300 > $J/ps.tmp 2>&1 && mv $J/ps.tmp $J/ps
  n=$((n + 1)); sleep 5; done ) &
echo $! > /run/rig-heartbeat.pid
@KVM_LOAD@ || rigfail "loading kvm_amd failed: $(dmesg | grep -i -E 'kvm|svm' | tail -5 | tr '\n' ' ')"
[ -c /dev/kvm ] || rigfail "kvm_amd loaded but /dev/kvm is missing"
chmod 0666 /dev/kvm
for m in tun loop vhost_vsock nf_tables veth bridge br_netfilter; do modprobe -q $m 2>/dev/null || true; done
echo "kvm-rig: QEMU @QEMU@ (-cpu @CPU@, TCG @TCG@), $(nproc) CPUs, $(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024)) MiB, kernel $(uname -r)," \
     "$(dmesg | grep -o 'Nested Paging enabled' | head -1), kvm_amd$(for p in nested npt vgif vls avic; do
        printf ' %s=%s' $p "$(cat /sys/module/kvm_amd/parameters/$p 2>/dev/null)"; done)," \
     "booted in $(cut -d' ' -f1 /proc/uptime) s" >> $J/output
python3 - <<'EOF' || rigfail "job.json: bad job description"
import json, os, shlex
job = json.load(open("/run/rig/job.json"))
with open("/run/rig/job.sh", "w") as f:
    # --share: each directory mounted read-write over the overlay at its host path, written through (cache=none)
    for i, path in enumerate(job["shares"]):
        f.write("mkdir -p %s && mount -t 9p -o trans=virtio,version=9p2000.L,cache=none,msize=@MSIZE@ share%d %s"
                " || { echo kvm-rig: mounting the share failed: %s; exit 125; }\n"
                % (shlex.quote(path), i, shlex.quote(path), shlex.quote(path)))
    f.write("cd %s || exit 125\n" % shlex.quote(job["cwd"]))
    for k, v in job["env"].items():
        f.write("export %s=%s\n" % (k, shlex.quote(v)))
    f.write("exec %s\n" % " ".join(shlex.quote(a) for a in job["argv"]))
EOF
env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    setsid bash $J/job.sh < /dev/null >> $J/output 2>&1
rc=$?
python3 - <<'EOF' >> $J/output 2>&1
import json, os, shutil
job = json.load(open("/run/rig/job.json"))
os.makedirs("/run/rig/files", exist_ok=True)
for i, p in enumerate(job["files"]):
    src = os.path.join(job["cwd"], p)
    if os.path.isfile(src):
        shutil.copyfile(src, "/run/rig/files/%d" % i)
    else:
        print("kvm-rig: asked to bring back %s, which the command did not write" % src)
EOF
sync
status $rc
sync
echo o > /proc/sysrq-trigger
sleep 60
"""


def module_load_order(tree: KernelTree, names: tuple[str, ...]) -> list[Path]:
    """Module files to insmod, dependencies first, each once (``modprobe --show-depends``)."""
    base = tree.modules.parent.parent.parent          # the root that holds lib/modules
    seen: list[Path] = []
    for name in names:
        out = run_quiet(["modprobe", "-d", str(base), "-S", tree.version, "--show-depends", name])
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "insmod":
                path = Path(parts[1])
                if path not in seen:
                    seen.append(path)
    return seen


def build_initramfs(tree: KernelTree, busybox: Path, cache: Path) -> Path:
    """A newc cpio (gzip) with busybox, the modules (decompressed) and stage one; cached by content hash."""
    modules = module_load_order(tree, INITRAMFS_MODULES)
    h = hashlib.sha256(STAGE1.encode() + str(MSIZE).encode())
    h.update(hashlib.sha256(busybox.read_bytes()).digest())
    blobs: list[tuple[str, bytes]] = []
    for i, path in enumerate(modules):
        data = path.read_bytes()
        if path.suffix == ".xz":
            data = lzma.decompress(data)
        elif path.suffix in (".zst", ".gz"):
            raise RigError(f"{path}: compressed modules other than .xz are not supported")
        blobs.append((f"m/{i:02d}.ko", data))
        h.update(data)
    out = cache / f"rig-initramfs-{h.hexdigest()[:16]}.cpio.gz"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".rig-initramfs-", dir=cache) as tmp:
        root = Path(tmp) / "root"
        (root / "bin").mkdir(parents=True)
        (root / "m").mkdir()
        shutil.copy2(busybox, root / "bin/busybox")
        for name, data in blobs:
            (root / name).write_bytes(data)
        (root / "modules.load").write_text("".join(f"/{name}\n" for name, _ in blobs))
        init = root / "init"
        init.write_text(STAGE1.replace("@MSIZE@", str(MSIZE)))
        init.chmod(0o755)
        names = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        cpio = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet", "-R", "0:0"], cwd=root,
                              input="\n".join(names).encode(), capture_output=True, check=False)
        if cpio.returncode != 0:
            raise RigError(f"cpio failed: {cpio.stderr.decode(errors='replace')}")
        part = Path(tmp) / "initramfs.cpio.gz"
        part.write_bytes(gzip.compress(cpio.stdout, compresslevel=1))
        os.replace(part, out)
    return out


# --------------------------------------------------------------------------------------------------------
# Running: QEMU, the job share, streaming, the watchdog
# --------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Job:
    argv: list[str]
    cwd: str
    env: dict[str, str]
    files: list[str]               # relative to cwd (or absolute): copied back to the same path here
    shares: list[str] = dataclasses.field(default_factory=list)   # host directories, read-write at the same path


def job_env(extra: list[str], environ: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in environ.items()
           if k in PASSED_ENV_NAMES or k.startswith(PASSED_ENV_PREFIXES)}
    for item in extra:
        if "=" not in item:
            raise RigError(f"--env {item!r}: expected NAME=VALUE")
        k, v = item.split("=", 1)
        env[k] = v
    env["SMOL_KVM_RIG"] = "1"      # tests that assert what only the rig guarantees (cgroup v2, the host template)
    return env


def default_memory_mib() -> int:
    """Half the host's memory, between 4 and 16 GiB: the rig's RAM is also its writable disk (tmpfs)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    except (ValueError, OSError):
        total = 8192
    return max(4096, min(16384, total // 2))


PATCHED_MARK = "smol rig: "   # .ci/rig-qemu's --with-pkgversion starts with it and names its fixes
REPORT_PREFIX = "smol-rig-qemu:"   # what .ci/rig-qemu.patch prints when one of its guards acts


def qemu_label(version: tuple[int, ...], text: str) -> str:
    """The banner's name for the rig's QEMU: its version, and the fixes of .ci/rig-qemu's build if it is one."""
    m = re.search(re.escape(PATCHED_MARK) + r"([^)\n]*)\)", text)
    return ".".join(map(str, version)) + (f" with {m.group(1).strip()}" if m else "")


def guard_reports(qemu_log: str, limit: int = 40) -> list[str]:
    """The lines the patched QEMU printed when a guard acted (evidence for docs/kvm-rig.md's flake table)."""
    return [line.strip() for line in qemu_log.splitlines() if line.startswith(REPORT_PREFIX)][:limit]


def qemu_version_text(qemu: str) -> str:
    try:
        return subprocess.run([qemu, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def qemu_version(qemu: str, text: str | None = None) -> tuple[int, ...]:
    """QEMU's version from ``--version`` ("QEMU emulator version 10.0.2 (Debian ...)"); (0,) when unreadable."""
    out = qemu_version_text(qemu) if text is None else text
    m = re.search(r"version (\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(g) for g in m.groups() if g is not None) if m else (0,)


_PARAM_RE = re.compile(r"[a-z][a-z0-9_]{0,31}=[A-Za-z0-9_.-]{1,32}")
_CPU_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+,=-]{0,127}")


def _module_param(text: str) -> str:
    if not _PARAM_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not PARAM=VALUE (letters, digits, '_', '.', '-')")
    return text


def _cpu_model(text: str) -> str:
    if not _CPU_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a QEMU CPU model")
    return text


def qemu_argv(qemu: str, tree: KernelTree, initramfs: Path, jobdir: Path, cpus: int, memory_mib: int,
              shares: list[str] | tuple[str, ...] = (), cpu_model: str = "max", tcg_thread: str = "multi",
              tb_size_mib: int = 0) -> list[str]:
    cmdline = ("console=ttyS0 panic=-1 loglevel=4 mitigations=off random.trust_cpu=on "
               "systemd.unified_cgroup_hierarchy=1 rdinit=/init")
    accel = f"tcg,thread={tcg_thread}" + (f",tb-size={tb_size_mib}" if tb_size_mib else "")
    return [qemu, "-accel", accel, "-cpu", cpu_model, "-smp", str(cpus),
            "-m", f"{memory_mib}M", "-M", "q35", "-nodefaults", "-nographic", "-no-reboot", "-nic", "none",
            "-kernel", str(tree.vmlinuz), "-initrd", str(initramfs), "-append", cmdline,
            "-serial", f"file:{jobdir / 'console.log'}", "-monitor", "none",
            "-device", "virtio-rng-pci",
            "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
            "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
            "-fsdev", f"local,id=rigjob,path={jobdir},security_model=none",
            "-device", "virtio-9p-pci,fsdev=rigjob,mount_tag=rigjob",
            *[arg for i, path in enumerate(shares)
              for arg in ("-fsdev", f"local,id=share{i},path={path},security_model=none",
                          "-device", f"virtio-9p-pci,fsdev=share{i},mount_tag=share{i}")]]


class Rig:
    """One rig run: a job directory, a QEMU process, a watchdog."""

    def __init__(self, args: argparse.Namespace, job: Job, out: IO[bytes]) -> None:
        self.args = args
        self.job = job
        self.out = out
        self.jobdir = Path(tempfile.mkdtemp(prefix="smol-kvm-rig-"))
        self.jobdir.chmod(0o755)
        self.proc: subprocess.Popen[bytes] | None = None
        self.offset = 0

    def console_tail(self, limit: int = 6000) -> str:
        try:
            data = (self.jobdir / "console.log").read_bytes()
        except OSError:
            return "(no console output)"
        return data[-limit:].decode(errors="replace")

    def processes(self) -> str:
        """The rig's last process list (stage two writes one every 30 s)."""
        try:
            return (self.jobdir / "ps").read_text(errors="replace")[-8000:]
        except OSError:
            return "(no process list)"

    def diagnostics(self) -> str:
        """What a failed or timed-out run shows: the console's tail and the last process list."""
        try:
            reports = guard_reports((self.jobdir / "qemu.log").read_bytes().decode(errors="replace"))
        except OSError:
            reports = []
        return (f"--- rig console (tail) ---\n{self.console_tail()}\n"
                f"--- rig processes (last list) ---\n{self.processes()}"
                + "".join(f"\n{line}" for line in reports))

    def prepare(self) -> list[str]:
        qemu = shutil.which(self.args.qemu) or self.args.qemu
        if not os.path.exists(qemu):
            raise RigError(f"{self.args.qemu} is not installed (apt-get install qemu-system-x86)")
        text = qemu_version_text(qemu)
        version = qemu_version(qemu, text)
        label = qemu_label(version, text)
        if version < (10, 0):
            log(f"warning: QEMU {'.'.join(map(str, version))} is older than 10.0; its TCG panicked the rig's kernel "
                "in 2 of 4 VM-tier runs (docs/kvm-rig.md); scripts/setup ci installs 10.0 from bookworm-backports")
        busybox = Path(self.args.busybox)
        if not busybox.is_file():
            raise RigError(f"{busybox} is missing (apt-get install busybox-static)")
        tree = kernel_tree(self.args)
        initramfs = build_initramfs(tree, busybox, default_cache_root())
        kvm_load = "false" if self.args.break_kvm else " ".join(["modprobe", "kvm_amd", *self.args.kvm_amd])
        init = (RIG_INIT.replace("@MODULES@", str(tree.modules)).replace("@KVER@", tree.version)
                .replace("@KVM_LOAD@", kvm_load).replace("@MSIZE@", str(MSIZE))
                .replace("@QEMU@", label).replace("@CPU@", self.args.cpu_model)
                .replace("@TCG@", f"thread={self.args.tcg_thread}"
                         + (f", tb-size={self.args.tb_size} MiB" if self.args.tb_size else "")))
        (self.jobdir / "init").write_text(init)
        (self.jobdir / "init").chmod(0o755)
        (self.jobdir / "job.json").write_text(json.dumps(dataclasses.asdict(self.job)))
        (self.jobdir / "output").touch()
        return qemu_argv(qemu, tree, initramfs, self.jobdir, self.args.cpus, self.args.memory, self.job.shares,
                         self.args.cpu_model, self.args.tcg_thread, self.args.tb_size)

    def pump(self) -> None:
        """Copy what the command wrote since the last call to our output."""
        try:
            with open(self.jobdir / "output", "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        if data:
            self.offset += len(data)
            self.out.write(data)
            self.out.flush()

    def heartbeat_age(self, started: float) -> tuple[bool, float]:
        """(has stage two started, seconds since its last heartbeat or since QEMU started)."""
        try:
            return True, time.time() - (self.jobdir / "heartbeat").stat().st_mtime
        except OSError:
            return False, time.time() - started

    def run(self) -> int:
        argv = self.prepare()
        started = time.time()
        # QEMU's own messages go to a file: a pipe read only at the end could fill up and stall QEMU.
        with open(self.jobdir / "qemu.log", "wb") as qemu_log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=qemu_log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = started + self.args.timeout if self.args.timeout else None
        while True:
            self.pump()
            if self.proc.poll() is not None:
                break
            up, age = self.heartbeat_age(started)
            if not up and age > self.args.boot_timeout:
                raise RigError(f"the rig did not reach stage two within {self.args.boot_timeout} s")
            if up and age > self.args.hang_timeout:
                raise RigError(f"the rig stopped answering: no heartbeat for {age:.0f} s "
                               f"(hang timeout {self.args.hang_timeout} s)")
            if deadline is not None and time.time() > deadline:
                self.pump()
                log(f"timed out after {self.args.timeout} s\n{self.diagnostics()}")
                return EXIT_TIMEOUT
            time.sleep(0.5)
        self.pump()
        qemu_out = (self.jobdir / "qemu.log").read_bytes().decode(errors="replace")
        for line in guard_reports(qemu_out):
            log(f"QEMU's guard acted: {line}")
        err = self.jobdir / "rig-error"
        if err.exists():
            raise RigError(err.read_text().strip())
        rc_file = self.jobdir / "rc"
        if not rc_file.exists():
            raise RigError(f"QEMU exited ({self.proc.returncode}) before the command's status was written"
                           + (f"; QEMU said: {qemu_out.strip()[-2000:]}" if qemu_out.strip() else ""))
        self.bring_back()
        log(f"rig run took {time.time() - started:.1f} s")
        return int(rc_file.read_text().strip())

    def bring_back(self) -> None:
        for i, name in enumerate(self.job.files):
            src = self.jobdir / "files" / str(i)
            if src.is_file():
                dst = Path(self.job.cwd) / name
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        if self.args.keep_console:
            try:
                shutil.copyfile(self.jobdir / "console.log", self.args.keep_console)
            except OSError:
                pass
        shutil.rmtree(self.jobdir, ignore_errors=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvm-rig", description="Run a command on real (nested, kvm_amd) KVM inside a QEMU TCG machine "
        "that sees this host's files read-only; stream its output, return its exit status.",
        epilog="example: scripts/kvm-rig -- .venv/bin/pytest tests/integration -q")
    p.add_argument("--cpus", type=int, default=min(os.cpu_count() or 2, 8), help="rig vCPUs (default: host CPUs, 8 at most)")
    p.add_argument("--memory", type=int, default=default_memory_mib(), help="rig memory in MiB (also its tmpfs disk)")
    p.add_argument("--cwd", default=os.getcwd(), help="directory to run the command in (default: here)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment (CI, SMOL_* and PYTEST_* pass through by themselves)")
    p.add_argument("--bring-back", action="append", default=[], metavar="PATH",
                   help="a file the command writes (relative to --cwd), copied back to the same path here")
    p.add_argument("--timeout", type=float, default=0, help="seconds for the whole run (default: none)")
    p.add_argument("--boot-timeout", type=float, default=300, help="seconds for the rig to start the command")
    p.add_argument("--hang-timeout", type=float, default=240, help="seconds without a heartbeat before giving up")
    p.add_argument("--keep-console", metavar="FILE", help="save the rig's serial console here")
    p.add_argument("--share", action="append", default=[], metavar="DIR",
                   help="a host directory (made if missing) the command sees read-write at the same path; what it "
                        "writes there reaches this host as it is written and stays if the rig dies")
    p.add_argument("--qemu", default=os.environ.get("SMOL_RIG_QEMU") or "qemu-system-x86_64",
                   help="QEMU binary (default: $SMOL_RIG_QEMU, e.g. .ci/rig-qemu's build with the SVM "
                        "event-injection fix, else qemu-system-x86_64)")
    p.add_argument("--busybox", default="/bin/busybox")
    p.add_argument("--kernel-root", help="use boot/vmlinuz-V and lib/modules/V under this root instead of apt's")
    p.add_argument("--cpu-model", default="max", type=_cpu_model,
                   help="QEMU's -cpu for the rig (default max; e.g. EPYC-v4: it must have svm)")
    p.add_argument("--tcg-thread", choices=("multi", "single"), default="multi",
                   help="QEMU's TCG threading: one host thread per vCPU (default), or one for all (slower)")
    p.add_argument("--tb-size", type=int, default=0, metavar="MIB",
                   help="QEMU's TCG translation cache in MiB (default: QEMU's); a small one flushes it often, "
                        "which kicks every vCPU out of its loop (docs/kvm-rig.md, the EVENTINJ flaw)")
    p.add_argument("--kvm-amd", action="append", default=[], type=_module_param, metavar="PARAM=VALUE",
                   help="a kvm_amd module parameter in the rig, e.g. vgif=0 (repeatable; docs/kvm-rig.md)")
    p.add_argument("--break-kvm", action="store_true", help=argparse.SUPPRESS)   # CI's check that a broken rig fails
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("no command given")
    return args


def share_paths(dirs: list[str], cwd: str) -> list[str]:
    """--share directories as absolute paths (relative ones from --cwd), each made if missing; a path QEMU's
    -fsdev option syntax cannot carry (a comma) is refused."""
    paths = []
    for d in dirs:
        path = os.path.normpath(os.path.join(cwd, d))
        if "," in path or path == "/":
            raise RigError(f"--share {d!r}: a directory other than / whose path has no comma")
        os.makedirs(path, exist_ok=True)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cwd = os.path.abspath(args.cwd)
        job = Job(argv=args.command, cwd=cwd, env=job_env(args.env, dict(os.environ)),
                  files=args.bring_back, shares=share_paths(args.share, cwd))
    except RigError as e:
        log(str(e))
        return EXIT_RIG
    rig = Rig(args, job, sys.stdout.buffer)
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return rig.run()
    except RigError as e:
        log(f"{e}\n{rig.diagnostics()}")
        return EXIT_RIG
    except KeyboardInterrupt:
        log("interrupted; powering the rig off")
        return 128 + (received[0] if received else signal.SIGINT)
    finally:
        rig.close()
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
