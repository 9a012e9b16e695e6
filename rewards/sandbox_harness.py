"""Runs inside the sandbox process (`python -I -S -B sandbox_harness.py JOB`); standard library only.

It computes values; it never judges them. The job holds the completion's code and, for assert tests, only the
expressions to evaluate (probes, e.g. `add(2, 3)`): no expected value, no expected output, no comparison. The
parent (rewards/sandbox.py, rewards/judge.py) decides every verdict from what comes back, so whatever the code does
to this process (replace builtins, walk its frames, write on its channel) changes at most the values it reports.

Order matters: read the job, limit resources, drop privileges, install the audit hook, and only then compile and
run the completion's code. Two modes:
- "probes": per test, run the code in a fresh namespace, then the test's import lines, then each probe; send
  {"test": i, "ran": true} and, per probe, {"test": i, "probe": j, "value": <plain data>} or {..., "raised": why}
  as JSON lines on the channel descriptor the parent passed.
- "program": per stdin/stdout test, fork a fresh child that runs the code as __main__ with the test's input on its
  stdin and, as its stdout, a pipe the parent created for that test and reads itself; send {"test": i, "exit":
  status}. This process never runs the code; each child gets the process limit and the audit hook after the fork
  and closes every descriptor but its own stdout before the code starts.
"""

import builtins
import json
import math
import os
import resource
import sys

MAX_DEPTH = 100


def limit_resources(job, processes=True):
    """CPU time, memory, file size, descriptors, no core files and (with `processes`) RLIMIT_NPROC: in program mode
    the children set that one after the fork, since it may count every process of the user."""
    seconds = max(1, int(job["time_limit"] + 0.999))
    memory = job["memory_mb"] * 1024 * 1024
    file_size = job["max_file_mb"] * 1024 * 1024
    limits = [(resource.RLIMIT_CPU, (seconds, seconds + 1)), (resource.RLIMIT_AS, (memory, memory)),
              (resource.RLIMIT_FSIZE, (file_size, file_size)), (resource.RLIMIT_CORE, (0, 0)),
              (resource.RLIMIT_NOFILE, (64, 64))]
    if hasattr(resource, "RLIMIT_NPROC") and processes:
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


def plain(value, depth=0):
    """`value` as JSON-ready plain data with its types kept (the parent's rewards.judge.decode_plain reads it);
    TypeError for anything that is not exactly a builtin value (an object with its own __eq__, a subclass of int,
    a generator)."""
    if depth > MAX_DEPTH:
        raise TypeError("returned data nested too deeply")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if -(2 ** 53) < value < 2 ** 53 else {"int": hex(value)}
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is list:
        return [plain(item, depth + 1) for item in value]
    if kind in (tuple, set, frozenset):
        return {kind.__name__: [plain(item, depth + 1) for item in value]}
    if kind is dict:
        return {"dict": [[plain(k, depth + 1), plain(v, depth + 1)] for k, v in value.items()]}
    raise TypeError(f"returned a {kind.__module__}.{kind.__qualname__}, which is not plain data (None, bool, int, "
                    f"float, str, bytes, or a list, tuple, dict or set of those)")


def run_probes(job, send):
    try:
        compiled = compile(job["code"], "<completion>", "exec")
    except (SyntaxError, ValueError) as error:
        send({"error": describe(error)})
        return
    for index, test in enumerate(job["tests"]):
        namespace = {"__name__": "solution", "__builtins__": builtins}
        try:
            exec(compiled, namespace)
            for line in test["setup"]:
                exec(compile(line, f"<test {index}>", "exec"), namespace)
        except MemoryError:
            send({"memory": f"MemoryError in test {index}"})
            return
        except BaseException as error:  # the code under test may raise anything, SystemExit included
            send({"test": index, "raised": describe(error)})
            continue
        send({"test": index, "ran": True})
        for number, source in enumerate(test["probes"]):
            try:
                value = plain(eval(compile(source, f"<test {index}>", "eval"), namespace))
            except MemoryError:
                send({"memory": f"MemoryError in test {index}"})
                return
            except BaseException as error:
                send({"test": index, "probe": number, "raised": describe(error)})
                continue
            send({"test": index, "probe": number, "value": value})
    send({"end": True})


def run_program(job, send):
    """Each stdin/stdout test in a child of its own; this process only forks, waits and reports exit statuses."""
    try:
        compiled = compile(job["code"], "<completion>", "exec")
    except (SyntaxError, ValueError) as error:
        send({"error": describe(error)})
        os.write(2, f"{describe(error)}\n".encode("utf-8", "replace"))
        return
    own = {test["stdout"] for test in job["tests"]} | {job["channel"]}  # this process's descriptors still open
    for index, test in enumerate(job["tests"]):
        given = f".stdin-{index}"
        with open(given, "wb") as f:
            f.write(test["input"].encode("utf-8"))
        try:
            child = os.fork()
        except OSError as error:
            send({"test": index, "exit": None, "raised": describe(error)})
            continue
        if child == 0:
            run_child(job, compiled, given, test["stdout"], own)
        os.close(test["stdout"])  # the child holds it: the parent sees the end of the output when the child ends
        own.discard(test["stdout"])
        _, status = os.waitpid(child, 0)
        send({"test": index, "exit": os.waitstatus_to_exitcode(status)})


def run_child(job, compiled, given, stdout, own):
    """In the forked child: the test's input as stdin, its pipe as stdout, nothing else of the parent's; then the
    process limit, the audit hook and the code, as a script. Never returns."""
    status = 1
    try:
        descriptor = os.open(given, os.O_RDONLY)
        os.dup2(descriptor, 0)
        os.close(descriptor)
        os.dup2(stdout, 1)
        for fd in own:
            os.close(fd)  # the other tests' pipes and the channel: the code can write on none of them
        if hasattr(resource, "RLIMIT_NPROC"):
            try:
                resource.setrlimit(resource.RLIMIT_NPROC, (job["max_processes"], job["max_processes"]))
            except (ValueError, OSError):
                pass
        if job["audit"]:
            install_audit_hook(job["workdir"], job["network"])
        status = run_script(compiled)
    finally:
        os._exit(status & 0xFF)


def run_script(compiled):
    """Run the code as __main__ and return its exit status, as `python script.py` would (a traceback on stderr,
    without this harness's frame, when it raised)."""
    status = 0
    try:
        exec(compiled, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as stop:
        status = stop.code if type(stop.code) is int else 0 if stop.code is None else 1
        if stop.code is not None and type(stop.code) is not int:
            os.write(2, f"{stop.code}\n".encode("utf-8", "replace"))
    except BaseException as error:  # MemoryError included: the traceback says so
        import traceback

        text = "".join(traceback.format_exception(type(error), error, error.__traceback__.tb_next))
        os.write(2, text.encode("utf-8", "replace")[-4000:])
        status = 1
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:
            pass
    return status


def main():
    job_path = sys.argv[1]
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    os.remove(job_path)
    os.chdir(job["workdir"])
    channel = job["channel"]

    def send(message):
        try:
            data = (json.dumps(message) + "\n").encode("utf-8", "replace")
            while data:
                data = data[os.write(channel, data):]
        except (OSError, TypeError, ValueError, RecursionError):
            pass

    program = job["mode"] == "program"
    limit_resources(job, processes=not program)
    drop_privileges(job)
    if job["audit"] and not program:
        install_audit_hook(job["workdir"], job["network"])
    (run_program if program else run_probes)(job, send)
    os._exit(0)  # skip interpreter teardown: atexit handlers the code registered do not run


if __name__ == "__main__":
    main()
