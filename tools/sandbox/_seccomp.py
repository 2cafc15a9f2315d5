"""A tiny seccomp filter for the sandbox: no new user namespaces.

Why: a process that creates its own user namespace can mount an unbounded tmpfs inside it and so
fill host memory past every rlimit. When vcpo runs unprivileged, bwrap's `--disable-userns` already
prevents that; as root (no user namespace, see `_bwrap.py`) this filter does. It makes `unshare`
and `clone` with CLONE_NEWUSER fail with EPERM and `clone3` fail with ENOSYS (its flags live in
memory a classic BPF filter cannot read; glibc then falls back to `clone`). Everything else is
allowed: this is not a general syscall allow-list.

Written as raw classic BPF (`struct sock_filter` records) because libseccomp is not a dependency.
"""

from __future__ import annotations

import platform
import struct

# struct seccomp_data offsets: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_OFFSET_NR = 0
_OFFSET_ARCH = 4
_OFFSET_ARG0_LOW = 16  # little-endian: the low 32 bits of args[0]

_BPF_LD_W_ABS = 0x20
_BPF_JEQ_K = 0x15
_BPF_JGE_K = 0x35
_BPF_JSET_K = 0x45
_BPF_RET_K = 0x06

_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_EPERM = 1
_ENOSYS = 38
_CLONE_NEWUSER = 0x10000000
_X32_SYSCALL_BIT = 0x40000000

# (AUDIT_ARCH_*, unshare, clone, clone3) per machine
_ARCHES = {
    "x86_64": (0xC000003E, 272, 56, 435),
    "aarch64": (0xC00000B7, 97, 220, 435),
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def no_new_user_namespaces_filter(machine: str | None = None) -> bytes | None:
    """The filter program for `bwrap --seccomp FD`, or None on machines we have no numbers for."""
    numbers = _ARCHES.get(machine or platform.machine())
    if numbers is None:
        return None
    arch, nr_unshare, nr_clone, nr_clone3 = numbers
    # A jump from instruction i with offset n lands on i + 1 + n.
    program = [
        _insn(_BPF_LD_W_ABS, _OFFSET_ARCH),  # 0
        _insn(_BPF_JEQ_K, arch, jt=0, jf=8),  # 1: foreign arch -> 10 allow
        _insn(_BPF_LD_W_ABS, _OFFSET_NR),  # 2
        _insn(_BPF_JGE_K, _X32_SYSCALL_BIT, jt=8, jf=0),  # 3: x32 ABI -> 12 eperm
        _insn(_BPF_JEQ_K, nr_unshare, jt=3, jf=0),  # 4: -> 8 check flags
        _insn(_BPF_JEQ_K, nr_clone, jt=2, jf=0),  # 5: -> 8 check flags
        _insn(_BPF_JEQ_K, nr_clone3, jt=4, jf=0),  # 6: -> 11 enosys
        _insn(_BPF_RET_K, _RET_ALLOW),  # 7
        _insn(_BPF_LD_W_ABS, _OFFSET_ARG0_LOW),  # 8
        _insn(_BPF_JSET_K, _CLONE_NEWUSER, jt=2, jf=0),  # 9: flag set -> 12 eperm, else 10
        _insn(_BPF_RET_K, _RET_ALLOW),  # 10
        _insn(_BPF_RET_K, _RET_ERRNO | _ENOSYS),  # 11
        _insn(_BPF_RET_K, _RET_ERRNO | _EPERM),  # 12
    ]
    return b"".join(program)
