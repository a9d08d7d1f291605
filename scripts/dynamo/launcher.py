"""Runs `python -m dynamo.vllm` (Dynamo 1.6.1) on vLLM 0.32; installed by
scripts/setup_dynamo.sh as .venv-dynamo/bin/dynamo-vllm.

vLLM 0.32 renamed vllm.v1.engine.utils.get_engine_zmq_addresses to
get_engine_zmq_bind_addresses; dynamo.vllm 1.6.1 imports the old name. The launcher gives the
function its old name too, then runs the module as __main__ with the same arguments.
"""

from __future__ import annotations

import runpy
import sys

import vllm.v1.engine.utils as engine_utils

if not hasattr(engine_utils, "get_engine_zmq_addresses"):
    engine_utils.get_engine_zmq_addresses = engine_utils.get_engine_zmq_bind_addresses  # type: ignore[attr-defined]
sys.argv[0] = "dynamo.vllm"
runpy.run_module("dynamo.vllm", run_name="__main__", alter_sys=True)
