"""Exit 1 unless two YAML streams hold the same Kubernetes objects (by kind, namespace and
name; each compared as data, so order of keys and of objects and YAML style do not count),
naming the first that differs: the Helm chart rendered against `prism deploy kubernetes`.

    python scripts/same_objects.py RENDERED.yaml MANIFESTS.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml


def objects(path: str) -> dict[tuple[str, str, str], dict]:
    out = {}
    for obj in yaml.safe_load_all(Path(path).read_text()):
        if obj:
            meta = obj["metadata"]
            out[(obj["kind"], meta.get("namespace", ""), meta["name"])] = obj
    return out


def main(rendered: str, written: str) -> int:
    left, right = objects(rendered), objects(written)
    for key in sorted(left.keys() | right.keys()):
        if left.get(key) != right.get(key):
            where = "only in " + (rendered if key not in right else written) if (
                key not in left or key not in right) else "different"  # fmt: skip
            print(f"{rendered} and {written}: {'/'.join(key)} {where}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
