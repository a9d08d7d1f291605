"""`PrefillCapScheduler`: vLLM's scheduler with its prefill cap (`--long-prefill-token-threshold`)
held only while the cap protects someone: another request that wants prefill tokens.

vLLM caps a long prefill's tokens per step whenever its engine holds more than one request,
decoding ones included. Behind a KV cache most prompts are hits with a few uncached tokens, and
the cap is what keeps them from waiting for a cold prompt's whole prefill. But when the other
requests only decode, nobody's first token waits: the cap then only splits the cold prompt over
more steps, each carrying every decode again, and its own first token comes later for no one's
gain (one long step costs the decodes one longer inter-token gap). This scheduler decides per
step: the cap holds while two or more requests want prefill tokens (waiting ones, whatever
keeps them waiting, and running ones whose prompt is not all computed) and is lifted otherwise.

Use: `vllm serve ... --long-prefill-token-threshold 256 --scheduler-cls
kvcr_vllm.prefill_cap.PrefillCapScheduler`. One name for both of vLLM's scheduling modes:
constructing it gives the variant built on vLLM's AsyncScheduler when the engine schedules
asynchronously and on its Scheduler otherwise. An engine without a cap refuses to start (the
class would change nothing) with the fix in the error, and so does a vLLM outside the versions
kvcr-vllm is tested with. vLLM warns about any scheduler class outside vLLM ("interface is not
public"): this one overrides `schedule()` only and reads the waiting queue's length, the
running requests' computed and prompt token counts, and the cap. It keeps a copy of the
engine's SchedulerConfig, so the cap it sets per step reaches no other holder of that config.
Works without kvcr's connector: it is a scheduling policy (docs/vllm.md, "Cache hits beside
cold prompts"; measured under "kvcr's rule for the cap").
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvcr_vllm import PREFILL_CAP_SCHEDULER, SUPPORTED_VLLM_TEXT, supports_vllm

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput


def cap_for_step(cap: int, waiting: int, prefilling: int) -> int:
    """The prefill cap for the next step: `cap` while two or more requests want prefill tokens
    (`waiting` not yet running, `prefilling` running with prompt tokens left), 0 (none)
    otherwise."""
    return cap if waiting + prefilling > 1 else 0


def checked_cap(vllm_config: VllmConfig, version: str = vllm.__version__) -> int:
    """The engine's cap; a clear error when it has none, or when vLLM is not a version this
    scheduler is tested against (it overrides a method of vLLM's non-public interface)."""
    if not supports_vllm(version):
        raise ValueError(
            f"--scheduler-cls {PREFILL_CAP_SCHEDULER} is tested with vLLM "
            f"{SUPPORTED_VLLM_TEXT} and this is vLLM {version}: drop --scheduler-cls "
            "(vLLM's own prefill cap rule applies) or install kvcr-vllm from a revision of "
            "this repository that supports it (pip install ./packages/kvcr-vllm; it is not "
            "on PyPI)")
    cap = vllm_config.scheduler_config.long_prefill_token_threshold
    if cap <= 0:
        raise ValueError(
            f"--scheduler-cls {PREFILL_CAP_SCHEDULER} holds vLLM's prefill cap only while another "
            "request wants prefill tokens, and this engine has no cap: add "
            "--long-prefill-token-threshold N (256 on the CPU engines docs/vllm.md measures), "
            "or drop --scheduler-cls")
    return cap


def _config(args: tuple[Any, ...], kwargs: dict[str, Any]) -> VllmConfig:
    """vLLM's scheduler constructor arguments' `vllm_config` (by keyword, as EngineCore
    passes it, or first)."""
    config: VllmConfig = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    return config


class PrefillCapScheduler:
    """See the module docstring. `PrefillCapScheduler(...)` returns a `_CappedScheduler` or an
    `_AsyncCappedScheduler` (both instances of this class), as vLLM's mode asks."""

    scheduler_config: Any
    waiting: Any
    running: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> PrefillCapScheduler:
        if cls is PrefillCapScheduler:
            cls = (_AsyncCappedScheduler if _config(args, kwargs).scheduler_config.async_scheduling
                   else _CappedScheduler)
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._cap = checked_cap(_config(args, kwargs))
        super().__init__(*args, **kwargs)
        self.scheduler_config = copy.copy(self.scheduler_config)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        prefilling = sum(1 for r in self.running if r.num_computed_tokens < r.num_prompt_tokens)
        self.scheduler_config.long_prefill_token_threshold = cap_for_step(
            self._cap, len(self.waiting), prefilling)
        out: SchedulerOutput = super().schedule(*args, **kwargs)  # type: ignore[misc]
        return out


class _CappedScheduler(PrefillCapScheduler, Scheduler):
    """Over vLLM's Scheduler (synchronous scheduling: the CPU engines)."""


class _AsyncCappedScheduler(PrefillCapScheduler, AsyncScheduler):
    """Over vLLM's AsyncScheduler (asynchronous scheduling)."""
