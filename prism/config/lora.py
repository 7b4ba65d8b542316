"""The LoRA adapters a mesh serves beside its base model, as `vllm serve` names them: the
engines' own LoRA settings are vLLM's flags (`--enable-lora`, `--max-loras`,
`--max-lora-rank`, `--max-cpu-loras`), handed to every engine."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from prism.config.flags import Flags, flag


@dataclass
class LoraConfig(Flags):
    lora_modules: list[str] = flag(
        help="LoRA adapters served beside the base model, each NAME=PATH (a directory in "
        "PEFT's format) or vLLM's JSON form with a name and a path; a request names "
        "one as its model (needs --enable-lora)",
        factory=list,
        metavar="NAME=PATH",
        several=True,
    )

    allowed_lora_dirs: list[str] = flag(
        help="directories under which LoRA adapters may be loaded at run time "
        "(/v1/load_lora_adapter, InferenceService.LoadAdapter); none: loading at run "
        "time is off",
        factory=list,
        metavar="DIR",
        several=True,
    )

    lora_state: str = flag(
        "",
        "a file that keeps the LoRA adapters served once they change at run time, so that "
        "fronts sharing it serve what any of them loaded, and a front started again what "
        "was loaded before (`prism serve` gives its fronts one); none: each processor's "
        "memory",
        metavar="FILE",
    )

    def modules(self) -> dict[str, str]:
        """Each adapter's path (absolute: every stage on this host finds it), by name.
        Raises ValueError on a malformed entry or a name given twice."""
        out: dict[str, str] = {}
        for entry in self.lora_modules:
            if entry.lstrip().startswith("{"):
                try:
                    given = json.loads(entry)
                    name, path = given["name"], given["path"]
                except (ValueError, KeyError, TypeError):
                    raise ValueError(
                        f"--lora-modules {entry}: JSON with a name and a path"
                    ) from None
            else:
                name, sep, path = entry.partition("=")
                if not sep or not name or not path:
                    raise ValueError(f"--lora-modules takes NAME=PATH, got {entry!r}")
            if name in out:
                raise ValueError(f"--lora-modules: adapter {name!r} given twice")
            out[name] = os.path.abspath(os.path.expanduser(path))
        return out
