"""Seeded sampling of a chunked prompt on vLLM's CPU backend (imported in the engine process).

vLLM samples a token after every chunk of a prompt cut by chunked prefill, then throws the
tokens of the unfinished chunks away and rewinds each such request's own generator (a
request with a `seed` has one) with `Generator.set_offset(get_offset() - 4)`: the offset of
CUDA's Philox generator. A CPU generator (Mersenne Twister) has no offset, so on the CPU
backend the first seeded request whose prompt is chunked raised "CPU Generator does not
use offset" and killed the engine core, and with it every request it held. Prism seeds
every prefill/decode request (both engines must draw the same first token), so sampled
requests with long prompts killed P/D meshes under load.

Here the rewind is done the way a CPU generator allows: the states of the generators whose
token will be thrown away are saved before sampling and put back after it, which leaves
each generator exactly where the unchunked prompt would have left it (so a seeded answer
does not depend on how the prompt was chunked), and vLLM's offset rewind never sees them.
On other platforms nothing changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def _discarded(runner: Any) -> dict[int, torch.Generator]:
    """The own generators of the requests whose sampled token this step throws away."""
    generators = runner.input_batch.generators
    mask = runner.discard_request_mask.np[: runner.input_batch.num_reqs]
    return {int(i): generators[int(i)] for i in np.nonzero(mask)[0] if int(i) in generators}


def _sample_then_rewind(sample: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(sample)
    def sampled(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = {i: generator.get_state() for i, generator in _discarded(self).items()}
        try:
            return sample(self, *args, **kwargs)
        finally:
            for i, state in saved.items():
                self.input_batch.generators[i].set_state(state)

    return sampled


def _without_offset_rewind(bookkeeping: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(bookkeeping)
    def kept(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Rewound already: out of vLLM's sight while it would rewind them by offset.
        held = _discarded(self)
        generators = self.input_batch.generators
        for i in held:
            del generators[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)

    return kept


def install() -> None:
    """Patches vLLM's CPU model runner (once)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "_prism_seeded_chunks", False):
        return
    CPUModelRunner._prism_seeded_chunks = True
    CPUModelRunner._sample = _sample_then_rewind(CPUModelRunner._sample)
    CPUModelRunner._bookkeeping_sync = _without_offset_rewind(CPUModelRunner._bookkeeping_sync)
