"""compose.yaml and the Dockerfile, read statically (no Docker engine here; `make lint`
checks compose.yaml against the Compose specification's JSON schema and both with
checkov): every Prism container runs a valid `prism` command, on the Consul registry,
hardened, with its own health check, and each mode's profile starts every role that mode
needs."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from prism.cli import build_parser
from prism.modes import MODES, EngineRole, modes_served
from prism.ops.deploy import security

ROOT = Path(__file__).parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
IMAGE = f"prism:{version('prism-mesh')}"
PRISM = {name: s for name, s in SERVICES.items() if s.get("image", "").startswith("prism:")}
DOCKERFILE = (ROOT / "Dockerfile").read_text()


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
    # UCX's TCP transport needs no capability (its CMA would need SYS_PTRACE).
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


@pytest.mark.parametrize("name", sorted(PRISM))
def test_every_prism_container_is_hardened(name):
    service = PRISM[name]
    # The image this checkout builds, by its version: never a moving tag.
    assert service["image"] == IMAGE
    assert service["user"] == f"{security.UID}:{security.UID}"
    assert service["read_only"] is True
    assert service["cap_drop"] == ["ALL"] and "cap_add" not in service
    assert service["security_opt"] == ["no-new-privileges:true"]
    # What a read-only container writes: temporary files, and the caches under HOME.
    assert set(service["tmpfs"]) == {"/tmp", security.HOME}


@pytest.mark.parametrize("name", sorted(PRISM))
def test_each_stage_names_its_own_health_for_the_images_check(name):
    args = parse(name)
    if args.command == "model":
        assert "PRISM_HEALTH" not in PRISM[name].get("environment", {})
        assert PRISM[name]["healthcheck"] == {"disable": True}
        return
    health = PRISM[name]["environment"]["PRISM_HEALTH"]
    if args.command == "gateway":
        assert health == f"http://127.0.0.1:{args.port}/health"
    else:
        assert health == f"127.0.0.1:{args.port}"
    assert build_parser().parse_args(["health", health]).target == health


def test_the_image_runs_as_the_unprivileged_user_and_checks_its_stage():
    assert f"USER {security.UID}:{security.UID}" in DOCKERFILE
    assert f"useradd --uid {security.UID}" in DOCKERFILE
    assert f"HOME={security.HOME}" in DOCKERFILE
    # Every cache the engines write lives under HOME, a volume when the root is read-only.
    names = "XDG_CACHE_HOME|HF_HOME|VLLM_CACHE_ROOT|TRITON_CACHE_DIR|TORCHINDUCTOR_CACHE_DIR"
    caches = re.findall(rf"({names})=(\S+)", DOCKERFILE)
    assert len(caches) == 5 and all(path.startswith(security.HOME + "/") for _, path in caches)
    assert re.search(r'^HEALTHCHECK .* CMD \["prism", "health"\]$', DOCKERFILE, re.M)
