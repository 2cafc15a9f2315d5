"""The program that runs *inside* a sandbox and executes requests (stdlib only, no vcpo imports).

`_sandbox_process.py` starts it as `python -I -c <this source> <config json>` under bubblewrap.
It is not imported by vcpo; it lives in a .py file so it can be read, linted and tested.

Life of a runner:
1. Start-up (trusted, before any request): as root, switch to the sandbox's unprivileged uid;
   set the base rlimits (processes, open files, file size, address space, no core files); tell the
   parent "ready" over the control socket (fd in the config). A warm pool keeps runners here.
2. For each request: receive the pipes for stdout and stderr (SCM_RIGHTS), the code and limits;
   lower the limits for this call, write input files, put stdin on fd 0, run the code in a
   module namespace that persists across requests (that is what a session is), then report
   exit code, exception, CPU time and fetched files, and point fds 0-2 back at /dev/null.
3. After the request marked `is_last` (one-shot calls) or when the parent closes the socket: exit.

Everything the user code does happens in this process, so it can tamper with the runner. That
only spoils its own report: isolation comes from bwrap, the uid and the rlimits, not from here.
"""

import io
import json
import os
import resource
import socket
import struct
import sys
import types

# base64, linecache, site, subprocess and traceback are imported where needed: start-up time of
# this runner is start-up time of every sandbox.

_HEADER = struct.Struct(">I")
_MAX_REQUEST_BYTES = 1 << 30


def _send(control, message):
    payload = json.dumps(message).encode()
    control.sendall(_HEADER.pack(len(payload)) + payload)


def _receive_exactly(control, size):
    chunks = []
    while size:
        chunk = control.recv(min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _receive(control):
    """One request and the fds passed with its header; (None, []) when the parent hung up."""
    fds = []
    header, ancillary, _flags, _addr = control.recvmsg(_HEADER.size, socket.CMSG_SPACE(8 * 4))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4]))
    if len(header) < _HEADER.size:
        rest = _receive_exactly(control, _HEADER.size - len(header)) if header else None
        if rest is None:
            return None, fds
        header += rest
    (size,) = _HEADER.unpack(header)
    if size > _MAX_REQUEST_BYTES:
        return None, fds
    payload = _receive_exactly(control, size)
    return (json.loads(payload) if payload is not None else None), fds


def _drop_privileges(uid, gid):
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise RuntimeError("could not switch to the sandbox uid")


def _set_limit(kind, soft, hard=None):
    """Set a limit, keeping the current hard limit when `hard` is None. Never asks for more than
    the current hard limit: raising it needs privileges the runner does not have."""
    current_hard = resource.getrlimit(kind)[1]
    if current_hard != resource.RLIM_INFINITY:
        hard = current_hard if hard is None else min(hard, current_hard)
    elif hard is None:
        hard = resource.RLIM_INFINITY
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(kind, (soft, hard))


def _set_base_limits(config):
    _set_limit(resource.RLIMIT_CORE, 0, 0)
    _set_limit(resource.RLIMIT_NPROC, config["max_processes"], config["max_processes"])
    _set_limit(resource.RLIMIT_NOFILE, config["max_open_files"], config["max_open_files"])
    _set_limit(resource.RLIMIT_FSIZE, config["max_file_size_bytes"], config["max_file_size_bytes"])
    _set_limit(resource.RLIMIT_AS, config["memory_limit_bytes"], config["memory_limit_bytes"])


def _set_call_limits(request):
    """Lower limits for one call. One-shot runners lower the hard limits too; sessions only the
    soft ones so that later calls can get their own (the base hard limits still bind)."""
    is_last = request["is_last"]
    memory = request["memory_limit_bytes"]
    _set_limit(resource.RLIMIT_AS, memory, memory if is_last else None)
    used = os.times()
    cpu_soft = int(used.user + used.system) + request["cpu_time_limit_s"]
    _set_limit(resource.RLIMIT_CPU, cpu_soft, cpu_soft + 1 if is_last else None)


def _add_site_packages(directories):
    """What `site` would do (the runner starts with -S to boot faster), minus editable installs:
    their `__editable__*.pth` finders point at host source trees the sandbox cannot see, and
    importing them costs more than the rest of start-up."""
    import site

    site.setquit()
    site.setcopyright()
    site.sethelper()
    known = set(sys.path)
    for directory in directories:
        if not os.path.isdir(directory) or directory in known:
            continue
        sys.path.append(directory)
        known.add(directory)
        for name in sorted(os.listdir(directory)):
            if name.endswith(".pth") and not name.startswith("__editable__"):
                site.addpackage(directory, name, known)


def _write_files(files):
    if not files:
        return
    import base64

    for path, content in files.items():
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(base64.b64decode(content))


def _read_files(paths, max_bytes):
    found, missing = {}, []
    if not paths:
        return found, missing
    import base64

    for path in paths:
        try:
            with open(path, "rb") as handle:
                found[path] = base64.b64encode(handle.read(max_bytes)).decode()
        except OSError:
            missing.append(path)
    return found, missing


def _stdin_fd(text):
    """A read-only fd with `text`, kept in memory rather than in the size-capped work dir."""
    if text is None:
        return os.open(os.devnull, os.O_RDONLY)
    fd = os.memfd_create("stdin")
    data = text.encode()
    while data:
        data = data[os.write(fd, data) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _install_stdio():
    """Fresh unbuffered text streams over fds 0-2, so output written before a kill is not lost."""
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
        )
        setattr(sys, name, stream)


def _flush_stdio():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # the code closed or replaced the stream; nothing left to flush
            continue


def _exit_code(value):
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _run_source(source, filename, namespace):
    import linecache

    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    exec(compile(source, filename, "exec"), namespace)


def _user_frames(tb):
    """The traceback from the first frame of the model's code on: the runner's are noise to it."""
    while tb is not None and tb.tb_frame.f_code.co_filename not in ("<code>", "<preamble>"):
        tb = tb.tb_next
    return tb


def _run_python(request, namespace):
    """Returns (exit code, exception class name or None, is the exception a MemoryError)."""
    try:
        if request["preamble"]:
            _run_source(request["preamble"], "<preamble>", namespace)
        _run_source(request["code"], "<code>", namespace)
    except SystemExit as exit_request:
        return _exit_code(exit_request.code), None, False
    except BaseException as error:
        try:
            import traceback

            traceback.print_exception(type(error), error, _user_frames(error.__traceback__))
        except BaseException:
            pass
        return 1, type(error).__name__, isinstance(error, MemoryError)
    return 0, None, False


def _run_bash(request):
    import subprocess

    completed = subprocess.run(["/bin/bash", "-c", request["code"]], stdin=0, stdout=1, stderr=2, check=False)
    code = completed.returncode
    return (128 - code if code < 0 else code), None, False


def _serve(request, fds, namespace, devnull):
    stdout_fd, stderr_fd = fds
    try:
        _set_call_limits(request)
        _write_files(request["files"])
        stdin_fd = _stdin_fd(request["stdin"])
    except BaseException:
        os.close(stdout_fd)
        os.close(stderr_fd)
        raise
    os.dup2(stdin_fd, 0)
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    for fd in (stdin_fd, stdout_fd, stderr_fd):
        os.close(fd)
    _install_stdio()
    start = os.times()
    try:
        if request["language"] == "bash":
            exit_code, exception, is_memory_error = _run_bash(request)
        else:
            exit_code, exception, is_memory_error = _run_python(request, namespace)
    finally:
        _flush_stdio()
        end = os.times()
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
    cpu_time_s = sum(end[:4]) - sum(start[:4])
    found, missing = _read_files(request["fetch_files"], request["max_fetch_file_bytes"])
    return {
        "kind": "done",
        "exit_code": exit_code,
        "exception": exception,
        "is_memory_error": is_memory_error,
        "cpu_time_s": cpu_time_s,
        "files": found,
        "missing_files": missing,
    }


def main():
    config = json.loads(sys.argv[1])
    if config["uid"] is not None:
        _drop_privileges(config["uid"], config["gid"])
    os.chdir(config["work_dir"])
    _set_base_limits(config)
    _add_site_packages(config["site_packages"])
    control = socket.socket(fileno=config["control_fd"])
    os.set_inheritable(control.fileno(), False)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = module
    _send(control, {"kind": "ready", "pid": os.getpid()})
    while True:
        request, fds = _receive(control)
        if request is None or len(fds) != 2:
            os._exit(0)
        try:
            report = _serve(request, fds, module.__dict__, devnull)
        except BaseException as error:
            report = {"kind": "runner_error", "message": f"{type(error).__name__}: {error}"}
        _send(control, report)
        if request["is_last"]:
            os._exit(0)


if __name__ == "__main__":
    main()
