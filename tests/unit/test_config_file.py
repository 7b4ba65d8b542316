"""`--config FILE` (prism.config.file): a command's flags from YAML, the command line's
winning; unknown keys refused by name, or handed to vLLM where the command passes vLLM's
engine arguments on; `--print-config` writes a file that reads back to the same config;
every example in examples/ is the mesh its flags are. Pure: parses, starts nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from prism.cli import _VLLM_FLAG_COMMANDS, build_parser, main
from prism.config import file as config_file
from prism.config.commands import MeshConfig, ProcessorStageConfig

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def parse(argv: list[str]):
    parser = build_parser()
    expanded = config_file.expand(argv, parser, _VLLM_FLAG_COMMANDS)
    return parser.parse_known_args(expanded)


def write(tmp_path: Path, values: dict) -> str:
    path = tmp_path / "flags.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return str(path)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.stem)
def test_each_example_is_the_mesh_its_flags_make(example):
    values = yaml.safe_load(example.read_text())
    flags = [token for key, value in values.items() for token in (f"--{key}", str(value))]
    from_file, unknown_file = parse(["serve", "--config", str(example)])
    from_flags, unknown_flags = parse(["serve", *flags])
    assert MeshConfig.from_args(from_file) == MeshConfig.from_args(from_flags)
    # Keys that are not Prism's go to vLLM's parser, as the same flags would.
    assert unknown_file == unknown_flags
    assert MeshConfig.from_args(from_file).serve.mode == values["mode"]


def test_flags_given_win_over_the_files_lists_included(tmp_path):
    values = {"model": "m", "mode": "e/p/d", "routing": "kv",
              "peer": ["worker=h:1", "encoder=h:2"], "log_level": "debug"}  # fmt: skip
    path = write(tmp_path, values)
    args, unknown = parse(["processor", "--config", path, "--routing", "random",
                           "--peer", "worker=h:3"])  # fmt: skip
    config = ProcessorStageConfig.from_args(args)
    assert unknown == [] and args.log_level == "debug"
    assert (config.processor.mode, config.routing.routing) == ("e/p/d", "random")
    assert config.peers.peer == ["worker=h:3"]


def test_a_key_no_flag_has_is_refused_by_name_or_handed_to_vllm(tmp_path, capsys):
    path = write(tmp_path, {"model": "m", "max_num_seqs": 8, "enforce_eager": False})
    with pytest.raises(SystemExit) as exited:
        main(["processor", "--config", path])
    assert exited.value.code == 2
    assert "has no flag --max-num-seqs (key 'max_num_seqs')" in capsys.readouterr().err
    _, unknown = parse(["serve", "--config", path])
    assert unknown == ["--max-num-seqs", "8", "--no-enforce-eager"]


def test_print_config_reads_back_to_the_same_config(tmp_path, capsys):
    argv = ["serve", "--model", "m", "--mode", "e/p/d", "--decode", "2", "--gpus", "none",
            "--routing", "kv", "--api-key", "secret-key"]  # fmt: skip
    assert main([*argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "secret-key" not in printed
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    again, _ = parse(["serve", "--config", str(path), "--api-key", "secret-key"])
    given, _ = parse(argv)
    assert MeshConfig.from_args(again) == MeshConfig.from_args(given)


def test_a_file_that_is_not_a_mapping_of_flags_is_refused(tmp_path, capsys):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(path)])
    assert "must hold a mapping of flags to values" in capsys.readouterr().err
