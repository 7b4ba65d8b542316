"""Which GPUs each stage of a one-machine mesh runs on (`prism serve --gpus`).

`--gpus` takes `auto` (every GPU the machine shows; the default), `none`, a list of GPU
indices (`0,1,2`), or, given once per role, where each role goes (`--gpus encoder=0
--gpus prefill=1 --gpus decode=2,3`). From a list, every vLLM engine gets GPUs of its own
while there are enough, and the encoders take what is left; with fewer GPUs than engines,
the engines share them, each allowed an equal part of the GPU's memory
(`--gpu-memory-utilization`), less a part kept for an encoder on the same GPU. A stage
is held to its GPUs with CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

# The part of a GPU's memory the vLLM engines on it take together, as vLLM's own default,
# and the part kept for an encoder that shares the GPU (its weights and activations).
ENGINES_SHARE = 0.9
ENCODER_SHARE = 0.1
# One entry per GPU, in the driver's order (nvidia-smi's indices).
DRIVER_GPUS = "/proc/driver/nvidia/gpus"


@dataclass(frozen=True)
class Unit:
    """A stage the plan places: its name, its role, and how many GPUs it spans (a vLLM
    engine's tensor-parallel size; 0 for a stage that is not a vLLM engine)."""

    name: str
    role: str
    engine_gpus: int = 0


@dataclass(frozen=True)
class Placement:
    gpus: tuple[int, ...]
    # The part of each of its GPUs' memory a vLLM engine may take (None: not an engine).
    memory_fraction: float | None = None


def visible_gpus() -> list[int]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES where set, else every GPU the
    NVIDIA driver shows (none without one)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(index) for index in visible.split(",") if index.strip().isdigit()]
    try:
        return list(range(len(os.listdir(DRIVER_GPUS))))
    except OSError:
        return []


def _indices(text: str, what: str) -> list[int]:
    try:
        indices = [int(index) for index in text.split(",")]
    except ValueError:
        raise ValueError(f"--gpus {what}: GPU indices are integers, as in 0,1") from None
    if not indices or min(indices) < 0 or len(set(indices)) != len(indices):
        raise ValueError(f"--gpus {what}: distinct GPU indices, as in 0,1")
    return indices


def parse(items: list[str], roles: set[str]) -> list[int] | dict[str, list[int]]:
    """`--gpus` as given: a list of GPUs, or each role's GPUs."""
    if not items or items == ["auto"]:
        return visible_gpus()
    if items == ["none"]:
        return []
    if len(items) == 1 and "=" not in items[0]:
        return _indices(items[0], items[0])
    by_role: dict[str, list[int]] = {}
    for item in items:
        role, sep, indices = item.partition("=")
        if not sep:
            raise ValueError(f"--gpus {item}: given more than once, each is ROLE=GPUS")
        if role not in roles:
            raise ValueError(f"--gpus {item}: this mode's roles are {', '.join(sorted(roles))}")
        if role in by_role:
            raise ValueError(f"--gpus {item}: {role} is given twice")
        by_role[role] = _indices(indices, item)
    return by_role


def place(units: list[Unit], gpus: list[int] | dict[str, list[int]]) -> dict[str, Placement]:
    """Each unit's GPUs and memory fraction; no GPUs anywhere when there are none."""
    if isinstance(gpus, dict):
        placed = _by_role(units, gpus)
    elif not gpus:
        return {unit.name: Placement(()) for unit in units}
    else:
        placed = _from_list(units, gpus)
    engines, encoders = Counter[int](), Counter[int]()
    for unit in units:
        for gpu in placed[unit.name]:
            (engines if unit.engine_gpus else encoders)[gpu] += 1
    plan = {}
    for unit in units:
        fraction = None
        if unit.engine_gpus:
            fraction = min(
                (ENGINES_SHARE - ENCODER_SHARE * encoders[gpu]) / engines[gpu]
                for gpu in placed[unit.name]
            )
            if fraction < 0.05:
                raise ValueError(
                    f"{unit.name} would get {fraction:.0%} of a GPU's memory: too many "
                    "stages on one GPU; give --gpus more GPUs"
                )
            fraction = int(fraction * 100) / 100
        plan[unit.name] = Placement(placed[unit.name], fraction)
    return plan


def _by_role(units: list[Unit], by_role: dict[str, list[int]]) -> dict[str, tuple[int, ...]]:
    """Each role's replicas take its GPUs in turn, as many as each spans."""
    placed: dict[str, tuple[int, ...]] = {}
    taken = Counter[str]()
    for unit in units:
        gpus = by_role.get(unit.role)
        if gpus is None:
            if unit.engine_gpus:
                raise ValueError(f"--gpus names no GPUs for {unit.role} ({unit.name})")
            placed[unit.name] = ()
            continue
        width = max(unit.engine_gpus, 1)
        if width > len(gpus):
            raise ValueError(f"{unit.name} spans {width} GPUs; --gpus gives {unit.role} {gpus}")
        start = taken[unit.role] * width % len(gpus)
        placed[unit.name] = tuple((gpus * 2)[start : start + width])
        taken[unit.role] += 1
    return placed


def _from_list(units: list[Unit], gpus: list[int]) -> dict[str, tuple[int, ...]]:
    engines = [unit for unit in units if unit.engine_gpus]
    needed = sum(unit.engine_gpus for unit in engines)
    placed: dict[str, tuple[int, ...]] = {}
    if needed <= len(gpus):
        free = iter(gpus)
        for unit in engines:
            placed[unit.name] = tuple(next(free) for _ in range(unit.engine_gpus))
        spare = list(free) or gpus[:1]
    else:
        if max(unit.engine_gpus for unit in engines) > 1:
            raise ValueError(
                f"the engines span {needed} GPUs together and only {len(gpus)} are given; "
                "with tensor parallelism, each engine needs GPUs of its own"
            )
        for i, unit in enumerate(engines):
            placed[unit.name] = (gpus[i % len(gpus)],)
        spare = gpus[:1]
    others = [unit for unit in units if not unit.engine_gpus]
    for i, unit in enumerate(others):
        placed[unit.name] = (spare[i % len(spare)],)
    return placed


def describe(name: str, placement: Placement) -> str:
    """One line of the plan that `prism serve` prints."""
    if not placement.gpus:
        return f"{name}: CPU"
    where = "GPU " + ",".join(map(str, placement.gpus))
    if placement.memory_fraction is None:
        return f"{name}: {where}"
    return f"{name}: {where}, {placement.memory_fraction:.0%} of its memory"
