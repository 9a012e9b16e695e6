"""Runs inside the sandbox process (`python -I -S -B sandbox_harness.py JOB`); standard library only.

Order matters: read the job, limit resources, drop privileges, install the audit hook, and only then compile
and run the completion's code. Results go to the original stdout as lines that start with the job's nonce, so
the code under test cannot forge them by printing.
"""

import io
import json
import os
import resource
import sys


class BoundedWriter(io.TextIOBase):
    """Stands in for sys.stdout: keeps the first `limit` characters, drops the rest."""

    def __init__(self, limit):
        self.parts, self.size, self.limit = [], 0, limit

    def writable(self):
        return True

    def write(self, text):
        if self.size < self.limit:
            self.parts.append(text[: self.limit - self.size])
            self.size += len(self.parts[-1])
        return len(text)

    def getvalue(self):
        return "".join(self.parts)


def limit_resources(job):
    seconds = max(1, int(job["time_limit"] + 0.999))
    memory = job["memory_mb"] * 1024 * 1024
    file_size = job["max_file_mb"] * 1024 * 1024
    limits = [(resource.RLIMIT_CPU, (seconds, seconds + 1)), (resource.RLIMIT_AS, (memory, memory)),
              (resource.RLIMIT_FSIZE, (file_size, file_size)), (resource.RLIMIT_CORE, (0, 0)),
              (resource.RLIMIT_NOFILE, (64, 64))]
    if hasattr(resource, "RLIMIT_NPROC"):
        limits.append((resource.RLIMIT_NPROC, (job["max_processes"], job["max_processes"])))
    for kind, value in limits:
        try:
            resource.setrlimit(kind, value)
        except (ValueError, OSError):
            pass  # this OS does not support the limit; the parent's report says which limits hold


def drop_privileges(job):
    if job.get("drop_to"):
        uid, gid = job["drop_to"]
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)


def install_audit_hook(workdir, allow_network):
    """Refuse, inside this interpreter: writes outside `workdir`, new processes, signals to other processes,
    ctypes (which could bypass all of this), raising resource limits and, unless allowed, the network."""
    root = os.path.realpath(workdir)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    process_events = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec",
                      "subprocess.Popen", "os.startfile", "pty.spawn"}
    refused_events = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "resource.setrlimit", "resource.prlimit",
                      "os.setuid", "os.setgid", "os.chroot"}
    path_events = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.symlink": (1,),
                   "os.link": (0, 1), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
                   "os.chflags": (0,), "os.lchflags": (0,), "os.lchmod": (0,), "shutil.copyfile": (1,),
                   "shutil.copymode": (1,), "shutil.copystat": (1,), "shutil.rmtree": (0,), "shutil.chown": (0,)}
    network_events = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
                      "socket.gethostbyname", "socket.gethostbyaddr", "socket.gethostbyname_ex"}
    own_pid = os.getpid()

    def inside(path):
        if isinstance(path, int) or path is None:
            return True  # an already open descriptor
        path = os.fsdecode(path)
        if path == os.devnull:
            return True
        full = os.path.realpath(os.path.join(os.getcwd(), path))
        return full == root or full.startswith(root + os.sep)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and flags & write_flags)
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the work directory is not allowed")
        elif event in path_events:
            for index in path_events[event]:
                if index < len(args) and not inside(args[index]):
                    raise PermissionError(f"sandbox: {event} on {args[index]!r} outside the work directory")
        elif event in process_events:
            raise PermissionError(f"sandbox: {event} is not allowed (no new processes)")
        elif event in refused_events or event in ("os.kill", "os.killpg") and args and args[0] not in (own_pid, 0):
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif not allow_network and (event in network_events or (event == "socket.__new__" and len(args) > 1
                                                              and args[1] not in (1,))):  # 1 = AF_UNIX
            raise PermissionError(f"sandbox: {event} is not allowed (no network)")

    sys.addaudithook(hook)


def describe(error):
    text = f"{type(error).__name__}: {error}"
    return text[:300]


def run_tests(job, report):
    code = job["code"]
    try:
        compiled = compile(code, "<completion>", "exec")
    except (SyntaxError, ValueError) as error:
        report("error", describe(error))
        return
    passed = 0
    for index, test in enumerate(job["tests"]):
        stdout = BoundedWriter(1 << 20)
        sys.stdout, sys.stderr = stdout, BoundedWriter(1 << 16)
        try:
            if test["kind"] == "io":
                sys.stdin = io.TextIOWrapper(io.BytesIO(test["input"].encode("utf-8")), encoding="utf-8")
                try:
                    exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})
                except SystemExit as stop:
                    if stop.code not in (None, 0):
                        raise
                ok = lines(stdout.getvalue()) == lines(test["output"])
                failure = None if ok else f"wrong output for test {index}"
            else:
                sys.stdin = io.StringIO("")
                namespace = {"__name__": "solution", "__builtins__": __builtins__}
                exec(compiled, namespace)
                exec(compile(test["code"], f"<test {index}>", "exec"), namespace)
                failure = None
        except MemoryError:
            sys.stdout = sys.__stdout__
            report("memory", f"MemoryError in test {index}")
            return
        except BaseException as error:  # the code under test may raise anything, SystemExit included
            failure = f"test {index}: {describe(error)}"
        finally:
            sys.stdout, sys.stderr, sys.stdin = sys.__stdout__, sys.__stderr__, sys.__stdin__
        if failure is None:
            passed += 1
            report("pass", str(index))
        else:
            report("fail", failure)
    report("done", f"{passed} {len(job['tests'])}")


def lines(text):
    return [line.rstrip() for line in text.strip().splitlines()]


def main():
    job_path = sys.argv[1]
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    os.remove(job_path)
    os.chdir(job["workdir"])
    results = os.dup(1)
    nonce = job["nonce"]

    def report(kind, text):
        line = f"{nonce} {kind} {json.dumps(text)}\n".encode("utf-8", "replace")
        try:
            os.write(results, line)
        except OSError:
            pass

    limit_resources(job)
    drop_privileges(job)
    if job["audit"]:
        install_audit_hook(job["workdir"], job["network"])
    run_tests(job, report)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: atexit handlers the code registered do not run


if __name__ == "__main__":
    main()
