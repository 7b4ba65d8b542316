"""compose.yaml, read statically (no Docker engine here; `make lint` checks it against the
Compose specification's JSON schema): every Prism container runs a valid `prism` command,
on the Consul registry, and each mode's profile starts every role that mode needs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from prism.cli import build_parser
from prism.modes import MODES, EngineRole, modes_served

COMPOSE = yaml.safe_load((Path(__file__).parents[2] / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
PRISM = {name: s for name, s in SERVICES.items() if s.get("image") == "prism:latest"}


def defaults(command: list[str]) -> list[str]:
    """The command as Compose runs it with none of its variables set."""
    return [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg) for arg in command]


def parse(name: str):
    return build_parser().parse_args(defaults(PRISM[name]["command"]))


def profile(mode: str) -> str:
    return mode.replace("/", "-")


@pytest.mark.parametrize("name", sorted(PRISM))
def test_every_command_is_a_valid_prism_invocation(name):
    args = parse(name)
    if args.command != "model":
        assert args.registry == "consul://consul:8500"
        assert args.host == "0.0.0.0"


def test_only_the_gateway_is_public_and_consul_answers_on_this_host_only():
    published = {name: s["ports"] for name, s in SERVICES.items() if "ports" in s}
    assert published == {"gateway": ["0.0.0.0:8000:8000"], "consul": ["127.0.0.1:8500:8500"]}
    assert parse("gateway").port == 8000
    assert SERVICES["consul"]["image"].startswith("hashicorp/consul:")
    assert "-dev" in SERVICES["consul"]["command"]


def test_engines_move_nixl_over_tcp_inside_containers():
    for name, service in PRISM.items():
        if name != "model":
            assert service["environment"]["UCX_TLS"] == "tcp,self"


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_profile_starts_the_roles_it_needs(mode):
    active = [name for name, s in PRISM.items()
              if not s.get("profiles") or profile(mode) in s["profiles"]]  # fmt: skip
    serving: dict[str, list[str]] = {}
    for name in active:
        args = parse(name)
        if args.command == "worker":
            if mode in modes_served(args.role, args.enable_mm_embeds):
                serving.setdefault(EngineRole(args.role).mesh_role, []).append(name)
            else:
                pytest.fail(f"{name} runs in profile {profile(mode)} but cannot serve {mode}")
        elif args.command == "encoder":
            serving.setdefault("encoder", []).append(name)
    assert sorted(serving) == sorted(MODES[mode].roles)
    assert all(len(names) == 1 for names in serving.values()), serving
