"""kvcr_vllm.prefill_cap on vLLM's own Scheduler and Request classes (no engine: the steps a
scheduler plans are what the policy decides; the servers of `kvcr bench serve` run it in real
engines, test_bench_serve.py). Risks: a cold prompt still split into capped steps when only
decodes share the engine (the policy does nothing); a hit left waiting behind a whole cold
prefill (the cap not held while another request wants prefill tokens); the wrong base class
for vLLM's scheduling mode; an engine started with the class and no cap (silently no policy),
or on a vLLM it was never tested with; the per-step cap leaking into the engine's shared
config."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="the policy is a subclass of vLLM's scheduler")

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvcr_vllm.prefill_cap import PrefillCapScheduler, cap_for_step, checked_cap

pytestmark = pytest.mark.unit

CAP = 256
BLOCK = 32
COLD = 1088  # a conversation's first turn in kvcr bench serve: 1,088 uncached tokens


def scheduler(cls: Any, model: str, cap: int = CAP, async_scheduling: bool = False) -> Any:
    model_config = ModelConfig(model=model, dtype="float32", seed=0, max_model_len=4096,
                               skip_tokenizer_init=True)
    config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=4096,
            long_prefill_token_threshold=cap, enable_chunked_prefill=True,
            is_encoder_decoder=False),
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK, cache_dtype="auto",
                                 enable_prefix_caching=False))
    config.cache_config.num_gpu_blocks = 512
    # the CPU platform turns asynchronous scheduling off; GPU engines run it by default
    config.scheduler_config.async_scheduling = async_scheduling
    kv_cache = KVCacheConfig(num_blocks=512, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1,
                                                      head_size=8, dtype=torch.float32))])
    return cls(vllm_config=config, kv_cache_config=kv_cache, block_size=BLOCK, log_stats=False,
               structured_output_manager=StructuredOutputManager(config))


def request(name: str, tokens: int, first: int) -> Request:
    return Request(name, list(range(first, first + tokens)),
                   SamplingParams(max_tokens=16, ignore_eos=True), None)


def planned(sched: Any) -> dict[str, int]:
    return dict(sched.schedule().num_scheduled_tokens)


def with_a_decoding_request(sched: Any) -> Any:
    """One short request whose prompt is all computed: from now on it only decodes."""
    sched.add_request(request("decoding", 64, 10_000))
    assert planned(sched) == {"decoding": 64}
    return sched


def test_the_decision() -> None:
    """Risk: the cap held or lifted on the wrong count of prefill-wanting requests."""
    assert cap_for_step(CAP, waiting=1, prefilling=0) == 0
    assert cap_for_step(CAP, waiting=0, prefilling=1) == 0
    assert cap_for_step(CAP, waiting=2, prefilling=0) == CAP
    assert cap_for_step(CAP, waiting=1, prefilling=1) == CAP


def test_a_cold_prompt_beside_decodes_only_runs_uncapped(tiny_model: str) -> None:
    """Risk: the policy does nothing. vLLM's own scheduler splits the cold prompt (a decoding
    request counts as another request); this one gives it the whole step."""
    stock = with_a_decoding_request(scheduler(Scheduler, tiny_model))
    stock.add_request(request("cold", COLD, 0))
    assert planned(stock)["cold"] == CAP
    ours = with_a_decoding_request(scheduler(PrefillCapScheduler, tiny_model))
    ours.add_request(request("cold", COLD, 0))
    assert planned(ours)["cold"] == COLD


def test_the_cap_holds_while_another_request_wants_prefill(tiny_model: str) -> None:
    """Risk: a hit waits behind a whole cold prefill. Two arrivals: both capped; a hit arriving
    mid-prefill: the cold prompt capped again that step; once the hit decodes, uncapped."""
    ours = scheduler(PrefillCapScheduler, tiny_model)
    ours.add_request(request("cold", COLD, 0))
    ours.add_request(request("hit", 128, 20_000))
    assert planned(ours) == {"cold": CAP, "hit": 128}
    ours.add_request(request("hit2", 128, 30_000))
    assert planned(ours) == {"cold": CAP, "hit2": 128}
    assert planned(ours) == {"cold": COLD - 2 * CAP}


def test_one_name_for_both_scheduling_modes(tiny_model: str) -> None:
    """Risk: vLLM's asynchronous scheduling silently lost (or its synchronous one broken)."""
    sync = scheduler(PrefillCapScheduler, tiny_model)
    assert isinstance(sync, PrefillCapScheduler) and not isinstance(sync, AsyncScheduler)
    run_async = scheduler(PrefillCapScheduler, tiny_model, async_scheduling=True)
    assert isinstance(run_async, PrefillCapScheduler) and isinstance(run_async, AsyncScheduler)


def test_an_engine_without_a_cap_is_refused_with_the_fix(tiny_model: str) -> None:
    """Risk: the class configured and nothing capped, silently."""
    with pytest.raises(ValueError, match="add --long-prefill-token-threshold N"):
        scheduler(PrefillCapScheduler, tiny_model, cap=0)


def test_an_untested_vllm_is_refused_with_the_fix(tiny_model: str) -> None:
    """Risk: an override of vLLM's non-public scheduler interface run on a vLLM it was never
    tested with (silently wrong schedules)."""
    config = scheduler(PrefillCapScheduler, tiny_model).vllm_config
    assert checked_cap(config) == CAP
    with pytest.raises(ValueError, match=r"this is vLLM 0\.99\.1: drop --scheduler-cls"):
        checked_cap(config, version="0.99.1")


def test_the_engines_config_keeps_its_cap(tiny_model: str) -> None:
    """Risk: the per-step cap written into the config the engine's other parts hold."""
    ours = with_a_decoding_request(scheduler(PrefillCapScheduler, tiny_model))
    ours.add_request(request("cold", COLD, 0))
    planned(ours)
    assert ours.scheduler_config.long_prefill_token_threshold == 0
    assert ours.vllm_config.scheduler_config.long_prefill_token_threshold == CAP
