"""`prism serve`: every stage of a mode as its own OS process on one machine.

The launcher picks free loopback ports, wires the stages together through the static
registry (`--peer ROLE=ADDRESS`), waits until every stage reports healthy, restarts a
stage that exits (prism.ops.supervisor), and on SIGINT/SIGTERM (or when a stage keeps dying)
stops them all. Children also get SIGTERM from the kernel if the launcher itself dies,
so no stage outlives it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from prism.config.commands import MeshConfig, ServeConfig
from prism.ops import fronts, gpus, phases, scaling
from prism.ops.phases import Progress
from prism.ops.plan import check_lora, check_model, plan
from prism.ops.stage_process import StageProcess, prepare_child
from prism.ops.supervisor import Supervisor
from prism.ops.template import Template, runs
from prism.rpc.ports import PortInUse
from prism.runtime import processes

log = logging.getLogger(__name__)


class Mesh:
    """Starts and stops a planned set of stages."""

    def __init__(self, stages: list[StageProcess], template: Template | None = None):
        self.stages = stages
        # Where the stages it runs are forked from (prism.ops.template); the others, and
        # all without one, are spawned.
        self.template = template
        # The stages' output, relayed by one thread each, through one lock.
        self._output = threading.Lock()
        self._relays: list[threading.Thread] = []
        # Where the gates of the stages that start in turn are (`spawn`), once one does.
        self._gates: tempfile.TemporaryDirectory | None = None
        self._owns_template = False

    @classmethod
    def forking(cls, stages: list[StageProcess]) -> Mesh:
        """A mesh as `prism serve` runs one: the stages a template can run are forked from
        one of its own (`Template.for_stages`), which ends as the mesh stops."""
        mesh = cls(stages, Template.for_stages(stages))
        mesh._owns_template = True
        return mesh

    def stage(self, name: str) -> StageProcess:
        """The stage called `name`, or the first `name-N` replica."""
        return next(s for s in self.stages if s.name in (name, f"{name}-0"))

    def address(self, name: str) -> str:
        return self.stage(name).address

    def start(
        self, timeout: float = ServeConfig.start_timeout, log: IO | None = None,
        stages: list[StageProcess] | None = None, report: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        """Starts every stage, or those of `stages` (output to `log` if given, else to
        stdout), and waits until they serve; `report` is told each stage's phase as it
        changes."""
        chosen = list(self.stages if stages is None else stages)
        if self.template is not None:
            if report is not None:
                report("importing what the stages run, once for all (prism.ops.template)")
            self.template.wait_ready(timeout)
        for stage in chosen:
            self.spawn(stage, log)
        self._wait_healthy(chosen, timeout, report)

    def restart(
        self, name: str, argv: list[str] | None = None, timeout: float = ServeConfig.start_timeout,
        log: IO | None = None,
    ) -> None:  # fmt: skip
        """Stops the stage `name` and starts it again, with `argv` in place of its own if
        given, at the same address; waits until it is healthy."""
        stage = self.stage(name)
        if stage.process is not None:
            processes.stop(stage.process, grace=15)
        if argv is not None:
            stage.argv = argv
        self.spawn(stage, log)
        self._wait_healthy([stage], timeout)

    def spawn(self, stage: StageProcess, log: IO | None = None) -> None:
        """Starts `stage`, its output relayed to `log` (else stdout); one that waits for
        others (`after`) imports meanwhile and starts its engine once they serve."""
        stage.progress = Progress()
        env = {**os.environ, **stage.env}
        if stage.after:
            self._gates = self._gates or tempfile.TemporaryDirectory(prefix="prism-gates-")
            gate = Path(self._gates.name) / stage.name
            gate.unlink(missing_ok=True)
            env[processes.START_GATE] = str(gate)
            stage.progress = Progress(f"importing, then waiting for {', '.join(stage.after)}")
        if self.template is not None and runs(stage):
            stage.process = self.template.spawn(stage.argv, env, stage.cpus)
        else:
            stage.process = subprocess.Popen(
                stage.argv,
                env=env,
                # Through the launcher, which names the stage on each line and reads its
                # phase.
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                # Its own process group, so that stop() also reaches the processes a stage
                # spawned (vLLM's engine core) even when the stage itself died abruptly.
                # Not its own session: the kernel shares CPU equally between sessions
                # (autogroups), whatever their niceness, and the engine is to run nicer
                # than every stage that feeds it.
                process_group=0,
                preexec_fn=functools.partial(prepare_child, stage.cpus),
            )
        width = max(len(s.name) for s in self.stages)
        prefix = f"{stage.name:<{width}} | " if stage.tag_lines else ""
        level = logging.getLevelName(stage.log_level.upper())

        def relay(lines: IO[str]) -> None:
            # A file of the relay's own, as a child's inherited descriptor was: the stage's
            # output still reaches `log` after the caller has closed its handle to it.
            with (
                open(os.dup(log.fileno()), "w", errors="replace")
                if log is not None
                else contextlib.nullcontext(sys.stdout)
            ) as out:
                phases.relay(lines, out, prefix, level, stage.progress, self._output,
                             json_stage="" if stage.tag_lines else stage.name)  # fmt: skip

        thread = threading.Thread(
            target=relay, args=(stage.process.stdout,), name=f"relay-{stage.name}", daemon=True
        )
        thread.start()
        self._relays.append(thread)
        if stage.after:
            threading.Thread(
                target=self._open_gate, args=(stage, gate), name=f"gate-{stage.name}", daemon=True
            ).start()

    def _open_gate(self, stage: StageProcess, gate: Path) -> None:
        """Lets `stage` start its engine once the stages it waits for serve."""
        before = [s for s in self.stages if s.name in stage.after]
        process = stage.process
        while not all(s.healthy() for s in before):
            if process is None or process.poll() is not None:
                return
            time.sleep(0.5)
        with contextlib.suppress(FileNotFoundError):  # the mesh stopped meanwhile
            gate.touch()
        stage.progress.enter("starting the engine")

    def _wait_healthy(
        self, chosen: list[StageProcess], timeout: float,
        report: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        deadline = time.monotonic() + timeout
        pending, told = list(chosen), dict.fromkeys(stage.name for stage in chosen)
        while pending:
            self.check_alive(pending)
            for stage in pending:
                if stage.healthy():
                    stage.progress.enter(phases.SERVING)
            pending = [stage for stage in pending if stage.progress.phase != phases.SERVING]
            for stage in chosen:
                if report is not None and told[stage.name] != stage.progress.phase:
                    told[stage.name] = stage.progress.phase
                    report(f"{stage.name}: {stage.progress.phase} "
                           f"({stage.progress.elapsed():.0f} s)")  # fmt: skip
            if pending and time.monotonic() > deadline:
                late = "; ".join(f"{s.name} {s.progress.describe()}" for s in pending)
                raise TimeoutError(
                    f"stages not serving after {timeout:.0f} s (--start-timeout): {late}"
                )
            if pending:
                time.sleep(0.5)

    def check_alive(self, stages: list[StageProcess] | None = None) -> None:
        """Raises if a stage (of `stages`) has exited."""
        for stage in self.stages if stages is None else stages:
            if stage.process is not None and (code := stage.process.poll()) is not None:
                raise RuntimeError(
                    f"{stage.name} exited ({processes.exit_reason(code)}) while "
                    f"{stage.progress.phase}"
                )

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to every stage, front first, so that no new work reaches the stages
        behind it; after `grace` seconds, SIGKILL. A stage that still does not go is
        reported and left (prism.runtime.processes)."""
        running = [s.process for s in reversed(self.stages) if s.process is not None]
        for process in running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in running:
            processes.finish(process, grace=max(0.1, deadline - time.monotonic()))
        # What the stages said last reaches the output before it may be closed.
        for thread in self._relays:
            thread.join(timeout=max(0.1, deadline - time.monotonic()))
        if self._gates is not None:
            self._gates.cleanup()
        for directory in {s.scratch for s in self.stages if s.scratch}:
            shutil.rmtree(directory, ignore_errors=True)
        if self._owns_template and self.template is not None:
            self.template.close()


class _StopRequested(Exception):
    pass


def _raise_stop(signum: int, frame: object) -> None:
    raise _StopRequested


def endpoints(config: MeshConfig, mesh: Mesh) -> dict:
    """Where a running mesh answers: its public APIs, and each stage."""
    host, kserve_port = config.http.http_host or config.serve.host, config.gateway.kserve_grpc_port
    front = "front" if config.serve.front == "combined" else "processor"
    # The plan says where the REST API answers (the front's, or the gateway's).
    url = next(stage.url for stage in mesh.stages if stage.url)
    # Fronts that share their ports (front-0, front-1, …) share the public gRPC API's too.
    grpc = next(stage.address for stage in mesh.stages if stage.name.startswith(front))
    return {
        "mode": config.serve.mode,
        "model": config.model.served_model_name or config.model.model,
        "openai": f"{url}/v1",
        "grpc": grpc,
        "kserve_grpc": f"{host}:{kserve_port}" if kserve_port else None,
        "pid": os.getpid(),
        "stages": [
            {"name": stage.name, "role": stage.name.rpartition("-")[0] or stage.name,
             "address": stage.address, "metrics": stage.metrics_url,
             "gpus": list(stage.placement.gpus),
             "gpu_memory_fraction": stage.placement.memory_fraction}
            for stage in mesh.stages
        ],
    }  # fmt: skip


def describe(status: dict) -> str:
    """`endpoints` as `prism serve` prints them once ready."""
    lines = [
        f"prism ({status['mode']}) ready: {status['openai']}",
        f"  OpenAI API  {status['openai']}",
        f"  gRPC        {status['grpc']}  (prism.v1.InferenceService)",
    ]
    if status["kserve_grpc"]:
        lines.append(f"  KServe v2   {status['kserve_grpc']}  (inference.GRPCInferenceService)")
    lines.append("  stages:")
    width = max(len(stage["name"]) for stage in status["stages"])
    lines += [
        f"    {s['name']:<{width}}  {s['role']:<9}  {s['address']}  metrics {s['metrics']}"
        for s in status["stages"]
    ]
    return "\n".join(lines)


def _write_status(path: str, status: dict) -> None:
    """Whole or not at all: a script polling for the file never reads half of it."""
    partial = f"{path}.partial"
    with open(partial, "w") as out:
        json.dump(status, out, indent=2)
    os.replace(partial, path)


def _say(as_json: bool, line: str) -> None:
    """Tells the user `line`: on stderr, or as a JSON log line where the mesh logs JSON."""
    if as_json:
        log.warning("%s", line)
    else:
        print(f"prism: {line}", file=sys.stderr, flush=True)


def _show(as_json: bool, lines: str) -> None:
    """Shows `lines` (the GPU plan, the endpoints): on stdout, or as one JSON log line."""
    if as_json:
        log.warning("%s", lines)
    else:
        print(lines, flush=True)


def run(config: MeshConfig) -> int:
    """Runs the mesh in the foreground until a signal, restarting the stages that exit
    (prism.ops.supervisor) until one exits too often; once it is ready, prints its
    endpoints (and writes them to `--status-file` as JSON, if given)."""

    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    as_json = config.log.log_format == "json"
    say = functools.partial(_say, as_json)
    planned = config.planner.planner != "none"
    try:
        check_model(config.model.model)
        check_lora(config)
        claimed = fronts.claim_ports(config)
        stages, starting = scaling.plan_mesh(config) if planned else (plan(config),) * 2
    except (ValueError, PortInUse) as exc:
        say(str(exc))
        return 2
    mesh = Mesh.forking(stages)
    placed = [stage for stage in mesh.stages if stage.placement.gpus]
    if placed:
        _show(as_json, "\n".join(["prism: GPU plan", *(
            f"  {gpus.describe(stage.name, stage.placement)}" for stage in placed)]))  # fmt: skip
    written = False
    try:
        mesh.start(config.serve.start_timeout, stages=starting, report=say)
        supervisor = Supervisor(mesh, list(starting), report=say)
        planner = None
        status = endpoints(config, mesh)
        if planned:
            planner, status["planner_metrics"] = scaling.start(config, mesh, supervisor)
        if config.serve.status_file:
            _write_status(config.serve.status_file, status)
            written = True
        _show(as_json, describe(status))
        while True:
            supervisor.poll()
            if planner is not None:
                planner.poll()
            time.sleep(0.5)
    except _StopRequested:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        say(str(exc))
        return 1
    finally:
        # Signals during the shutdown itself must not cut it short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if written:
            # A file left behind would name endpoints that are gone.
            with contextlib.suppress(FileNotFoundError):
                os.remove(config.serve.status_file)
        mesh.stop()
        for fd in (fd for fd in claimed if fd is not None):
            os.close(fd)
