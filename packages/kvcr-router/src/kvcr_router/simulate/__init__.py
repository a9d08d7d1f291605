"""The router simulator: replays requests against modelled workers, routed by the real
kvcr-router cost model and block indexer (docs/router-simulator.md).

Layers, each importing only those above it: `workload` (synthetic streams) and `trace`
(Mooncake-style files) make requests; `fleet` models workers; `simulation` is the event loop
and the routing policies; `report` condenses runs; `sweep` and `bench` run many simulations;
`cli` parses `kvcr-router simulate` arguments. `main` is the subcommand's entry point.
"""

from kvcr_router.simulate.cli import main
from kvcr_router.simulate.fleet import FleetConfig
from kvcr_router.simulate.simulation import REFERENCE_WEIGHTS, Policy, RunResult, Simulation
from kvcr_router.simulate.sweep import TUNED_WEIGHTS
from kvcr_router.simulate.trace import TraceError, read_trace, write_trace
from kvcr_router.simulate.workload import SimRequest, WorkloadConfig, WorkloadKind, generate

__all__ = ["REFERENCE_WEIGHTS", "TUNED_WEIGHTS", "FleetConfig", "Policy", "RunResult",
           "SimRequest", "Simulation", "TraceError", "WorkloadConfig", "WorkloadKind",
           "generate", "main", "read_trace", "write_trace"]
