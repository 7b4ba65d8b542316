"""Make PyPI's CUDA-only torchvision importable on a CPU-only torch.

The only torchvision that matches torch 2.13 is a CUDA build whose compiled ops need
libcudart; importing it on the CPU build dies in `register_fake("torchvision::nms")`.
vLLM's LLaVA and Qwen2-VL paths need only its pure-Python transforms, so drop the
compiled libraries and register the fake ops only when the compiled ops exist.
Idempotent: running it twice changes nothing more.
"""

import importlib.util
import pathlib
import sys

GUARD = "def _register_fake(name):"
PATCH = """
def _register_fake(name):
    # Compiled ops are absent on the CPU-only install: skip their fake kernels.
    if torchvision.extension._has_ops():
        return torch.library.register_fake(name)
    return lambda fn: fn

"""


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("torchvision is not installed; nothing to do")
        return 0
    root = pathlib.Path(spec.origin).parent
    for name in ("_C.so", "image.so"):
        (root / name).unlink(missing_ok=True)
    meta = root / "_meta_registrations.py"
    text = meta.read_text()
    if GUARD not in text:
        anchor = "@functools.lru_cache(None)\ndef get_meta_lib():"
        text = text.replace(anchor, PATCH.lstrip("\n") + "\n" + anchor, 1)
        text = text.replace("@torch.library.register_fake(", "@_register_fake(")
        meta.write_text(text)
    print(f"torchvision at {root} stripped for CPU use")
    return 0


if __name__ == "__main__":
    sys.exit(main())
