"""The worker stage: `EngineService` in one role, on a vLLM engine
(prism.services.worker.servicer) or, with `--engine sim`, on a simulated one without a
model (prism.services.worker.sim). The engine's modules are imported only when chosen:
the simulated worker starts without loading vLLM or torch."""

from __future__ import annotations

import argparse


async def serve(args: argparse.Namespace) -> None:
    if args.engine == "sim":
        from prism.services.worker import sim

        await sim.serve(args)
    else:
        from prism.services.worker import servicer

        await servicer.serve(args)
