"""Typed configs (prism.config): a field's flag goes into a parser, back into the field and
onto a stage's command line unchanged, and `prism serve` hands every flag it takes on."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import pkgutil
import typing
from typing import Any

import pytest

import prism.config
from prism.cli import build_parser
from prism.config import sim
from prism.config.commands import (
    EncoderStageConfig,
    FrontStageConfig,
    GatewayStageConfig,
    MeshConfig,
    ModelStageConfig,
    ProcessorStageConfig,
    RunBatchConfig,
    ServeConfig,
    StageConfig,
    WorkerStageConfig,
)
from prism.config.common import LogConfig, ModelConfig
from prism.config.flags import Flags, flag
from prism.config.planner import PlannerStageConfig
from prism.ops.plan import plan

CONFIGS = [
    cls
    for info in pkgutil.iter_modules(prism.config.__path__, "prism.config.")
    for module in [importlib.import_module(info.name)]
    for cls in vars(module).values()
    if isinstance(cls, type)
    and issubclass(cls, Flags)
    and cls is not Flags
    and cls.__module__ == module.__name__
]
# A whole command's config: no default to compare with (most need --model); tested below.
WHOLES = (MeshConfig, StageConfig, ModelStageConfig, WorkerStageConfig, EncoderStageConfig,
          ProcessorStageConfig, FrontStageConfig, GatewayStageConfig,
          PlannerStageConfig, RunBatchConfig)  # fmt: skip
LEAVES = [cls for cls in CONFIGS if cls not in WHOLES]


def other(field: dataclasses.Field, kind: Any) -> Any:
    """A value of `field` (of type `kind`) other than its default."""
    spec = field.metadata["flag"]
    default = field.default
    if kind is bool:
        return True
    if typing.get_origin(kind) is list:
        return ["a", "b"]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return next(member for member in kind if member != default)
    if spec.choices is not None:
        return next(choice for choice in spec.choices if choice != default)
    if kind is str:
        return f"{field.name}-value"
    return (default or 0) + (2.5 if kind is float else 7)


def changed(cls: type[Flags]) -> dict[str, Any]:
    """A value other than its default for every flag of `cls`."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: other(f, hints[f.name] if hints[f.name] != int | None else int)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if "flag" in f.metadata
    }


def parse(cls: type[Flags], argv: list[str]) -> Flags:
    parser = argparse.ArgumentParser()
    cls.add_cli_args(parser)
    return cls.from_args(parser.parse_args(argv))


@pytest.mark.parametrize("cls", LEAVES, ids=lambda cls: cls.__name__)
def test_every_flag_goes_from_argv_to_its_field_and_back(cls):
    values = changed(cls)
    config = cls(**values)
    flags = {f.name: f.metadata["flag"] for f in dataclasses.fields(cls) if "flag" in f.metadata}
    secret = {name for name, spec in flags.items() if spec.secret}
    read = parse(cls, config.to_argv())
    for name, value in values.items():
        assert getattr(read, name) == (value if name not in secret else getattr(cls(), name))
    # Defaults stay off the command line, but those a reader should see (where every flag
    # has a default).
    required = [f for f in dataclasses.fields(cls) if "flag" in f.metadata
                and f.default is f.default_factory is dataclasses.MISSING]  # fmt: skip
    if not required:
        always = {name for name, spec in flags.items() if spec.always}
        assert parse(cls, cls().to_argv()) == cls()
        assert {arg for arg in cls().to_argv() if arg.startswith("--")} == {
            f"--{name.replace('_', '-')}" for name in always
        }


def test_a_field_declares_its_flag_help_default_and_choices_once():
    @dataclasses.dataclass
    class Example(Flags):
        group = "example"
        name: str = flag(help="required, with no default")
        count: int = flag(3, "how many", aliases=("-n",), always=True)
        kind: str = flag("a", choices=("a", "b"))
        nice: int | None = flag(None, "an int, or nothing")
        tags: list[str] = flag(help="repeatable", factory=list, metavar="TAG")
        on: bool = flag(False, "a switch")

    parser = argparse.ArgumentParser()
    Example.add_cli_args(parser, count=5)
    by_dest = {action.dest: action for action in parser._actions}
    assert by_dest["name"].required and by_dest["name"].help == "required, with no default"
    assert by_dest["count"].option_strings == ["-n", "--count"]
    assert (by_dest["count"].default, by_dest["count"].type) == (5, int)
    assert by_dest["kind"].choices == ("a", "b")
    assert by_dest["nice"].type is int and by_dest["nice"].default is None
    assert by_dest["tags"].metavar == "TAG"
    args = parser.parse_args(["--name", "x", "--tags", "t1", "--tags", "t2", "--on"])
    config = Example.from_args(args)
    assert config == Example("x", 5, "a", None, ["t1", "t2"], True)
    assert config.to_argv() == ["--name", "x", "--count", "5", "--tags", "t1", "--tags", "t2",
                                "--on"]  # fmt: skip


def test_a_flags_minimum_is_refused_on_the_command_line_and_in_code(capsys):
    for command in ("serve", "worker"):
        with pytest.raises(SystemExit) as exit:
            build_parser().parse_args([command, "--model", "m", "--sim-engines", "0"])
        assert exit.value.code == 2
        assert "--sim-engines: must be at least 1, got 0" in capsys.readouterr().err
    assert (
        build_parser().parse_args(["worker", "--model", "m", "--sim-engines", "3"]).sim_engines == 3
    )
    with pytest.raises(ValueError, match="--sim-engines must be at least 1, got 0"):
        sim.SimEngineConfig(sim_engines=0)


@pytest.mark.parametrize(
    ("command", "cls", "port"),
    [("worker", WorkerStageConfig, 50051), ("encoder", EncoderStageConfig, 50052),
     ("processor", ProcessorStageConfig, 50050), ("gateway", GatewayStageConfig, 8000),
     ("front", FrontStageConfig, 50050)],
)  # fmt: skip
def test_a_stage_command_reads_its_whole_config_and_writes_it_back(command, cls, port):
    model = [] if command == "gateway" else ["--model", "m"]
    argv = [command, *model, "--registry", "consul://h:8500", "--upstream", "worker=21003"]
    config = cls.from_args(build_parser().parse_args(argv))
    assert config.registry.registry == "consul://h:8500"
    assert (config.connect.upstream, config.address.port) == (["worker=21003"], port)
    assert cls.from_args(build_parser().parse_args([command, *config.to_argv()])) == config


def test_serve_reads_its_flags_into_each_stages_config():
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--mode", "e/p/d", "--prefill", "2", "--max-images", "3",
         "--routing", "kv", "--tls-cert", "c.pem", "--request-timeout", "5"]
    )  # fmt: skip
    config = MeshConfig.from_args(args, log=LogConfig.from_args(args))
    assert (config.serve.mode, config.serve.prefill_workers) == ("e/p/d", 2)
    assert (config.model.model, config.media.max_images) == ("m", 3)
    assert (config.routing.routing, config.tls.tls_cert) == ("kv", "c.pem")
    assert config.gateway.request_timeout == 5.0 and config.log == LogConfig()


@pytest.mark.parametrize("front", ["split", "combined"])
def test_every_flag_serve_hands_on_reaches_a_stage(monkeypatch, front):
    """Each flag `prism serve` takes for its stages, set to something other than its
    default, is what some stage reads from its command line (the API key and the Consul
    token from its environment, where `ps` does not show them; a gateway apart takes the
    HTTP address as its own). The planner's flags are the launcher's own."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    hints = typing.get_type_hints(MeshConfig)
    own = ("model", "serve", "planner")
    parts = {f.name: changed(hints[f.name]) for f in dataclasses.fields(MeshConfig)
             if f.metadata.get("nested") and f.name not in own}  # fmt: skip
    parts["engine"]["engine"] = "sim"  # the simulated engine's flags go to sim engines only
    # Decodes enough to fill a process of --sim-engines.
    decodes = parts["sim"]["sim_engines"]
    config = MeshConfig(
        ModelConfig(**changed(ModelConfig)),
        ServeConfig("e/p/d", enable_mm_embeds=True, front=front, decode_workers=decodes),
        **{name: hints[name](**values) for name, values in parts.items()},
        log=LogConfig(**changed(LogConfig)),
    )
    planned = plan(config)
    read = [build_parser().parse_args(stage.argv[3:]) for stage in planned]
    http = next(stage for stage in planned if stage.name in ("gateway", "front"))
    assert http.env["PRISM_API_KEY"] == config.gateway.api_key
    assert "--api-key" not in http.argv
    del parts["gateway"]["api_key"]
    for stage in planned:
        assert stage.env["CONSUL_HTTP_TOKEN"] == config.registry.consul_token
        assert "--consul-token" not in stage.argv
    del parts["registry"]["consul_token"]
    if front == "split":
        gateway = build_parser().parse_args(http.argv[3:])
        assert (gateway.host, gateway.port) == (config.http.http_host, config.http.http_port)
        del parts["http"]
    given = {**changed(ModelConfig), **changed(LogConfig), "enable_mm_embeds": True}
    for values in parts.values():
        given |= values
    for name, value in given.items():
        assert any(getattr(args, name, None) == value for args in read), name
