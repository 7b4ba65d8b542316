"""Stages forked from a template process that has imported what they run.

Before a stage does anything it imports vLLM, torch and transformers: on a small machine
most of its start, paid again by every stage of a mesh and by every restart. The launcher
starts one template process that imports them once and then forks each stage it is asked
for. The child takes the stage's command line, environment, working directory, cores,
process group and output, and runs `prism.cli` as `python -m prism.cli` would, up to the
interpreter's normal exit; `ps` shows the stage's command line (as one string: psutil
reads it as one argument). The template reaps its children and tells the launcher each
one's exit status; the launcher's handle (`Forked`) stands in for `subprocess.Popen`.

A mesh on GPUs is spawned as before: each stage begins its CUDA runtime in a process of
its own, and there a start is the engine's compilation more than imports.

`python -m prism.ops.template SOCKET LOG_FORMAT MODULE...` is the template itself.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Iterable
from pathlib import Path

import setproctitle

from prism import logs
from prism.ops.stage_process import StageProcess, prepare_child

# What each stage command runs, for the template to import: the modules its `serve`
# imports as it starts (a command's package alone leaves vLLM, the engine and the
# servicers to be imported after the fork), and prism.cli, which dispatches to it.
MODULES = {
    "worker": ("prism.services.worker.serving",),
    "encoder": ("prism.services.encoder.serving", "prism.transfer.nixl"),
    "processor": ("prism.services.processor.serving", "prism.services.processor.servicer"),
    "front": ("prism.services.front", "prism.services.processor.servicer"),
    "gateway": ("prism.gateway.app",),
    "planner": ("prism.planner.loop",),
}
# A worker on a simulated engine imports neither vLLM nor torch.
SIM_WORKER = ("prism.services.sim.serving",)
ALL_MODULES = sorted({"prism.cli", *SIM_WORKER, *(m for ms in MODULES.values() for m in ms)})
_CLI = ["-m", "prism.cli"]
# A request: the stage's command line and environment, as JSON.
_MAX_REQUEST = 1 << 20
# How long the template waits for the launcher to watch a child it forked.
_ACKNOWLEDGE_S = 30


def _command(argv: list[str]) -> str | None:
    """The stage command of a `prism.cli` command line of this Python, if it is one."""
    if argv[:3] != [sys.executable, *_CLI]:
        return None
    # Its global flags (--log-level LEVEL ...) come first; their values name no command.
    return next((word for word in argv[3:] if word in MODULES), None)


def imports(argv: list[str]) -> tuple[str, ...]:
    """What the stage command line `argv` (one the template `runs`) imports as it starts."""
    command = _command(argv)
    assert command is not None, argv
    engine = argv[argv.index("--engine") + 1] if "--engine" in argv else ""
    return (
        "prism.cli",
        *(SIM_WORKER if command == "worker" and engine == "sim" else MODULES[command]),
    )


def runs(stage: StageProcess) -> bool:
    """Whether the template can run `stage`: a `prism.cli` stage command of this Python,
    on no GPU."""
    return _command(stage.argv) is not None and not stage.placement.gpus


class Forked:
    """A stage forked by the template, as the launcher holds a `subprocess.Popen`: `pid`,
    `stdout`, `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`. A pidfd
    watches and signals it, so that a signal never reaches a later process given its pid."""

    def __init__(self, args: list[str], pid: int, report: socket.socket, stdout: int) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = open(stdout, errors="replace")  # noqa: SIM115 (the relay closes it)
        self._report = report
        # Open until the handle goes: a thread may wait on it as another finds it ended.
        self._pidfd = os.pidfd_open(pid)
        weakref.finalize(self, os.close, self._pidfd)
        self._lock = threading.Lock()
        # Until told, the template leaves the child unreaped, so that the pidfd is its.
        report.send(b"watching")

    def poll(self) -> int | None:
        return self._ended(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._ended(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def _ended(self, timeout: float | None) -> int | None:
        if self.returncode is None and select.select([self._pidfd], [], [], timeout)[0]:
            with self._lock:
                if self.returncode is None:
                    self.returncode = self._code()
                    self._report.close()
        return self.returncode

    def _code(self) -> int:
        # The template reports it as soon as it has reaped the child; a template that is
        # gone took its children with it (their parent-death signal).
        if select.select([self._report], [], [], 10)[0]:
            with contextlib.suppress(OSError, ValueError, KeyError):
                return int(json.loads(self._report.recv(256))["code"])
        return -signal.SIGTERM

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Template:
    """The template process, importing `modules` with `env` (the launcher's own by
    default), logging what they say as it starts in `log_format`, as the stages do;
    `spawn` forks a stage from it. It ends with `close`, or with the process that made
    it."""

    def __init__(
        self, modules: Iterable[str], env: dict[str, str] | None = None, log_format: str = "text"
    ) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="prism-template-")
        self._socket = Path(self._directory.name) / "socket"
        argv = [sys.executable, "-m", __name__, str(self._socket), log_format]
        self.process = subprocess.Popen(
            [*argv, *sorted(set(modules))],
            env=env,
            stdin=subprocess.DEVNULL,
            # Out of the terminal's group: Ctrl-C is the launcher's to act on.
            process_group=0,
            preexec_fn=lambda: prepare_child(set()),
        )

    @classmethod
    def for_stages(cls, stages: Iterable[StageProcess]) -> Template | None:
        """A template for those of `stages` it can run (`runs`), if any, and none for a
        mesh on GPUs (whose platform vLLM would find in the template, through the GPUs'
        driver). Some settings take effect as a module is imported (vLLM's log level):
        the template imports with the environment all those stages share."""
        stages = list(stages)
        chosen = [stage for stage in stages if runs(stage)]
        if not chosen or any(stage.placement.gpus for stage in stages):
            return None
        shared = dict(chosen[0].env)
        for stage in chosen[1:]:
            shared = {k: v for k, v in shared.items() if stage.env.get(k) == v}
        modules = {m for stage in chosen for m in imports(stage.argv)}
        log_format = "text" if all(stage.tag_lines for stage in chosen) else "json"
        return cls(modules, {**os.environ, **shared}, log_format)

    def spawn(
        self, argv: list[str], env: dict[str, str], cpus: set[int], timeout: float = 300
    ) -> Forked:
        """Forks `argv` (of a stage the template `runs`) with `env`, on `cpus` (all when
        empty), in a process group of its own, its output and errors to a pipe
        (`Forked.stdout`); waits up to `timeout` s for the template to have imported its
        modules."""
        connection = self._connect(timeout)
        connection.settimeout(timeout)
        read, write = os.pipe()
        try:
            request = {"argv": argv, "env": env, "cwd": os.getcwd(), "cpus": sorted(cpus)}
            socket.send_fds(connection, [json.dumps(request).encode()], [write])
            reply = connection.recv(256)
            if not reply:
                raise RuntimeError(f"the stage template could not start {_command(argv)}")
            return Forked(argv, int(json.loads(reply)["pid"]), connection, read)
        except BaseException:
            os.close(read)
            connection.close()
            raise
        finally:
            os.close(write)

    def wait_ready(self, timeout: float = 300) -> None:
        """Waits until the template has imported its modules and takes requests."""
        self._connect(timeout).close()

    def _connect(self, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        while True:
            if (code := self.process.poll()) is not None:
                raise RuntimeError(f"the stage template exited (code {code})")
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                connection.connect(str(self._socket))
                return connection
            except (FileNotFoundError, ConnectionRefusedError):
                connection.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stage template did not start within {timeout:.0f} s")
            time.sleep(0.1)

    def close(self) -> None:
        """Ends the template; the stages forked from it are the launcher's to stop."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait()
        self._directory.cleanup()


def _serve(path: str) -> dict:
    """The template's loop: forks a child for each request. Returns only in a child, with
    its request."""
    # The loop wakes when a request comes or a child exits; a mesh idles without it.
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, wake_read], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(children)
        if listener not in readable:
            continue
        connection, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(connection, _MAX_REQUEST, 1)
        if not message or len(fds) != 1:
            connection.close()
            continue
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        with warnings.catch_warnings():
            # The template's only other threads are idle native pools its imports started
            # (torch's), as in the worker that vLLM forks its engine core from.
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                pid = os.fork()
            except OSError as exc:
                # The launcher is told (no reply); the stages already forked keep running.
                print(f"prism.ops.template: cannot fork: {exc}", file=sys.stderr, flush=True)
                os.close(fds[0])
                connection.close()
                continue
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for held in [listener, connection, *children.values()]:
                held.close()
            os.close(wake_read)
            os.close(wake_write)
            request["output"] = fds[0]
            return request
        os.close(fds[0])
        # As the child does itself: whichever comes first, the launcher finds its group.
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        # The child is reaped once the launcher watches it (its pidfd open), or has gone.
        with contextlib.suppress(OSError):
            connection.settimeout(_ACKNOWLEDGE_S)
            connection.send(json.dumps({"pid": pid}).encode())
            connection.recv(16)
        children[pid] = connection


def _reap(children: dict[int, socket.socket]) -> None:
    for pid in list(children):
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            reaped, status = pid, 255 << 8
        if reaped == 0:
            continue
        connection = children.pop(pid)
        with contextlib.suppress(OSError):
            connection.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
        connection.close()


def _become(request: dict) -> None:
    """What `subprocess.Popen` (launcher.Mesh.spawn) gives a spawned stage, in the child."""
    os.setpgid(0, 0)
    prepare_child(set(request["cpus"]))
    # What `ps` and psutil show of it: the command line and name of a spawned stage.
    setproctitle.setproctitle(" ".join(request["argv"]))
    setproctitle.setthreadtitle(os.path.basename(request["argv"][0]))
    for fd in (1, 2):
        os.dup2(request["output"], fd)
    os.close(request["output"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    torch = sys.modules.get("torch")
    if torch is not None:
        # OpenMP read its thread count as the template loaded it; a spawned stage's would
        # read its own environment and cores.
        wanted = request["env"].get("OMP_NUM_THREADS", "")
        torch.set_num_threads(int(wanted) if wanted.isdigit() else len(os.sched_getaffinity(0)))


def main(argv: list[str]) -> int:
    path, log_format, *modules = argv
    # What the imports say (vLLM warns before it configures its logging) in the stages'
    # format: a JSON mesh's output is JSON throughout.
    logs.configure("warning", log_format, role="template")
    for module in modules:
        importlib.import_module(module)
    request = _serve(path)
    _become(request)
    # As `python -m MODULE ARGS` runs it: the module as __main__, ARGS in sys.argv.
    _, _, module, *args = request["argv"]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
