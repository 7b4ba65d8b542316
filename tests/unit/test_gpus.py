"""`prism serve --gpus`: which GPUs each encoder and engine gets, and what share of their
memory each engine may take."""

from __future__ import annotations

import pytest
from support.meshes import mesh_config

from prism.ops import gpus
from prism.ops.gpus import Placement, Unit, place
from prism.ops.launcher import endpoints
from prism.ops.plan import plan


def units(*engines: str, encoders: int = 0, width: int = 1) -> list[Unit]:
    return [Unit(name, name.rpartition("-")[0], width) for name in engines] + [
        Unit(f"encoder-{i}", "encoder") for i in range(encoders)
    ]


def test_no_gpus_leaves_every_stage_on_the_cpu():
    assert place(units("prefill-0", encoders=1), []) == {
        "prefill-0": Placement(()), "encoder-0": Placement(()),
    }  # fmt: skip


def test_one_gpu_is_shared_with_memory_fractions_that_leave_room_for_the_encoder():
    plan = place(units("prefill-0", "decode-0", encoders=1), [0])
    assert plan["prefill-0"] == plan["decode-0"] == Placement((0,), 0.4)
    assert plan["encoder-0"] == Placement((0,))
    # Without an encoder the engines split vLLM's own 0.9.
    assert place(units("worker-0"), [3])["worker-0"] == Placement((3,), 0.9)


def test_enough_gpus_give_each_engine_its_own_and_the_encoders_the_rest():
    plan = place(units("prefill-0", "decode-0", encoders=2), [4, 5, 6])
    assert plan["prefill-0"] == Placement((4,), 0.9)
    assert plan["decode-0"] == Placement((5,), 0.9)
    assert plan["encoder-0"] == plan["encoder-1"] == Placement((6,))
    # None left: the encoders share the first, and its engine makes room.
    plan = place(units("prefill-0", "decode-0", encoders=1), [0, 1])
    assert plan["prefill-0"] == Placement((0,), 0.8)
    assert plan["decode-0"] == Placement((1,), 0.9)
    assert plan["encoder-0"] == Placement((0,))


def test_tensor_parallel_engines_span_gpus_of_their_own():
    plan = place(units("prefill-0", "decode-0", width=2), [0, 1, 2, 3])
    assert plan["prefill-0"].gpus == (0, 1) and plan["decode-0"].gpus == (2, 3)
    with pytest.raises(ValueError, match="GPUs of its own"):
        place(units("prefill-0", "decode-0", width=2), [0, 1])


def test_roles_can_be_placed_by_hand():
    given = gpus.parse(["encoder=0", "prefill=1", "decode=2,3"], {"encoder", "prefill", "decode"})
    plan = place(units("prefill-0", "decode-0", "decode-1", encoders=1), given)
    assert plan["encoder-0"] == Placement((0,))
    assert plan["prefill-0"] == Placement((1,), 0.9)
    assert (plan["decode-0"], plan["decode-1"]) == (Placement((2,), 0.9), Placement((3,), 0.9))
    with pytest.raises(ValueError, match="no GPUs for decode"):
        place(units("prefill-0", "decode-0"), {"prefill": [0]})


@pytest.mark.parametrize(
    ("items", "message"),
    [(["0,x"], "integers"), (["0,0"], "distinct"), (["worker=0"], "roles are"),
     (["prefill=0", "prefill=1"], "given twice"), (["0", "1"], "ROLE=GPUS")],
)  # fmt: skip
def test_nonsense_gpus_are_refused(items, message):
    with pytest.raises(ValueError, match=message):
        gpus.parse(items, {"prefill", "decode"})


def test_too_many_engines_on_one_gpu_are_refused():
    with pytest.raises(ValueError, match="too many stages"):
        place(units(*(f"decode-{i}" for i in range(20))), [0])


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert gpus.parse(["auto"], set()) == [2, 5]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus.parse(["auto"], set()) == []
    assert gpus.parse(["none"], set()) == []


def test_serve_holds_each_stage_to_its_gpus_and_prints_the_plan(monkeypatch):
    config = mesh_config("e/p/d", "m", gpus=["0,1"],
                        vllm_flags=["--max-num-seqs", "8"])  # fmt: skip
    stages = {stage.name: stage for stage in plan(config)}
    prefill, decode, encoder = stages["prefill-0"], stages["decode-0"], stages["encoder-0"]
    assert prefill.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert decode.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert encoder.env["CUDA_VISIBLE_DEVICES"] == "0"
    # GPU engines are not pinned to cores, as CPU engines are.
    assert not prefill.cpus and "VLLM_CPU_OMP_THREADS_BIND" not in prefill.env
    for stage, fraction in ((prefill, "0.8"), (decode, "0.9")):
        assert stage.argv[-2:] == ["--gpu-memory-utilization", fraction]
        assert stage.argv[stage.argv.index("--max-num-seqs") + 1] == "8"
    assert "--gpu-memory-utilization" not in encoder.argv
    assert "CUDA_VISIBLE_DEVICES" not in stages["front"].env
    assert gpus.describe("prefill-0", prefill.placement) == "prefill-0: GPU 0, 80% of its memory"
    # A fraction the user gives wins.
    config.vllm_flags = ["--gpu-memory-utilization", "0.3"]
    (prefill,) = [stage for stage in plan(config) if stage.name == "prefill-0"]
    assert prefill.argv.count("--gpu-memory-utilization") == 1


def test_the_status_names_each_stages_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")

    class Running:
        stages = plan(mesh_config("e/pd", "m"))

        def address(self, name: str) -> str:
            return "a"

    status = endpoints(mesh_config("e/pd", "m"), Running())  # type: ignore[arg-type]
    by_name = {stage["name"]: stage for stage in status["stages"]}
    assert by_name["worker-0"]["gpus"] == [7]
    assert by_name["worker-0"]["gpu_memory_fraction"] == 0.8
    assert by_name["front"]["gpus"] == []
