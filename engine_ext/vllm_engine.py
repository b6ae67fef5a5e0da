"""`Engine` on vLLM: its `AsyncLLM` in this process (the EngineCore runs in its own process),
with `AntiphonScheduler` wired in through `scheduler_cls` and the KV connector through
`kv_transfer_config`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any, cast

from antiphon.engine_ext.chat_tokenizer import ChatTokenizer
from antiphon.engine_ext.config import (
    ASYNC_SCHEDULER_CLS,
    SCHEDULER_CLS,
    WORKER_EXTENSION_CLS,
    EngineConfig,
    set_cpu_threading,
)
from antiphon.engine_ext.costfit import Machine, machine_fingerprint
from antiphon.engine_ext.engine import (
    Engine,
    EngineDeadError,
    EngineRequestError,
    EngineRequestFailedError,
)
from antiphon.engine_ext.engine_processes import (
    engine_process_ids,
    kill_engine_processes,
    remove_rpc_dir,
    use_private_rpc_dir,
    use_spawned_engine,
)
from antiphon.engine_ext.logprobs import prompt_logprobs, token_logprobs
from antiphon.engine_ext.model_defaults import model_sampling_defaults, resolve_dtype
from antiphon.engine_ext.policies import policy_class
from antiphon.engine_ext.profiler import EngineLimits, prepare_cost_model
from antiphon.engine_ext.types import (
    TIER_TOKENS_KEY,
    ChatTurn,
    Delta,
    EngineHealth,
    GenerationParams,
    RequestClass,
    ToolSpec,
)
from antiphon.tiering.build import unopened_ssd_file
from antiphon.tiering.config import TieringConfig
from antiphon.tiering.manager import unopened_file_error

logger = logging.getLogger(__name__)
ENGINE_STOP_TIMEOUT_S = 15.0  # for the engine's processes to exit before they are killed

# How long `forget` waits for a deleted session's KV to be erased (its SSD slots zeroed behind
# the writes queued before them) before it gives up; the server then tries again later.
FORGET_TIMEOUT_S = 120.0
PROFILING_SESSION = "antiphon-profiling"  # the session id profiling's KV is erased under

# vLLM ends a request it could not serve with these finish reasons (its own server answers
# them with a 500): the reply is not one, and a client must not take it for one.
FAILED_FINISH_REASONS = {
    "error": "vLLM ended the request with an error (a KV load that failed)",
    "abort": "vLLM aborted the request (its engine is stopping)",
}
# ...and where the request constrains its reply to a schema, an error is the schema's: vLLM
# ends it so when the schema's grammar allows no token (run again, it fails again).
SCHEMA_ERROR = ("the reply cannot follow the response_format schema: its grammar allows no "
                "token (vLLM ended the request with an error)")

# vLLM orders waiting requests by ascending priority value.
_PRIORITY = {RequestClass.RT: 0, RequestClass.BE: 1}


def default_scheduler_cls() -> str:
    """vLLM turns async scheduling off on the CPU backend; there the plain `Scheduler` base is
    faster, elsewhere `AsyncScheduler` keeps scheduling overlapped with execution."""
    from vllm.platforms import current_platform

    return SCHEDULER_CLS if current_platform.is_cpu() else ASYNC_SCHEDULER_CLS


def _extra_args(params: GenerationParams) -> dict[str, Any]:
    """What the scheduler reads from `SamplingParams.extra_args` in the EngineCore process."""
    extra: dict[str, Any] = {"antiphon_class": params.request_class.value,
                             "antiphon_session": params.session_id}
    if params.ttft_slo_s is not None:
        extra["ttft_slo_s"] = params.ttft_slo_s
    if params.tpot_slo_s is not None:
        extra["tpot_slo_s"] = params.tpot_slo_s
    return extra


def _tier_tokens(out: Any) -> tuple[int, int] | None:
    """(host, SSD) prompt tokens the KV tiers served the request (its connector's
    `kv_transfer_params`, on each of its outputs: a reply its client cancels has no finished
    one); None without tiers."""
    params = getattr(out, "kv_transfer_params", None) or {}
    loads = params.get(TIER_TOKENS_KEY)
    return None if loads is None else (int(loads[0]), int(loads[1]))


class VllmEngine(Engine):
    """vLLM `AsyncLLM` in process, with Antiphon's scheduler."""

    def __init__(self, config: EngineConfig, model_dir: Path,
                 tiering: TieringConfig | None = None, *, drain_timeout_s: float = 0.0) -> None:
        """`tiering` (when its `kv_tiering` is on) installs Antiphon's KV connector.

        `drain_timeout_s`: when a signal reaches vLLM's engine process itself (one sent to the
        server's whole process group: Ctrl-C in a terminal, systemd's default KillMode), it
        finishes its running requests for up to this long before it stops, as the server
        drains them (vLLM's `shutdown_timeout`); 0: it aborts them at once."""
        self.config = config
        self.drain_timeout_s = drain_timeout_s
        self.tiering = tiering if tiering is not None and tiering.kv_tiering else None
        self._tiering_off = tiering if self.tiering is None else None  # (its SSD file: `forget`)
        self.model_dir = model_dir
        self.dtype = resolve_dtype(config.dtype)
        self.model_name = config.served_model_name or model_dir.name
        self.max_model_len = config.max_model_len
        self._llm: Any = None
        self._tokenizer: ChatTokenizer | None = None  # `load_tokenizer`
        self._loading = False  # in `start`, until vLLM's engine is up
        self._stop_asked = False  # `stop_starting`
        self._rpc_dir: Path | None = None  # `use_private_rpc_dir`'s, while the engine runs

    async def start(self) -> None:
        started = time.monotonic()
        self._loading = True  # until vLLM's engine is up: `stop_starting` ends the start
        try:
            await self._start()
        finally:
            self._loading = False
        logger.info("vLLM engine for %s up in %.1f s", self.model_name,
                    time.monotonic() - started)
        await prepare_cost_model(self)

    async def _start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.load_tokenizer()
        c = self.config
        set_cpu_threading(c.cpu_reserved_cores, c.cpu_omp_spin_count)
        args = AsyncEngineArgs(
            model=str(self.model_dir),
            served_model_name=[self.model_name],
            max_model_len=c.max_model_len,
            kv_cache_memory_bytes=c.kv_cache_bytes,
            num_gpu_blocks_override=c.num_kv_pages,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=max(c.max_num_batched_tokens, c.max_model_len),
            dtype=cast(Any, self.dtype),
            enforce_eager=c.enforce_eager,
            enable_prefix_caching=c.enable_prefix_caching,
            seed=c.seed,
            scheduler_cls=c.scheduler_cls or default_scheduler_cls(),
            scheduling_policy=cast(Any, policy_class(c.policy).vllm_scheduling_policy),
            additional_config=c.scheduler_settings.to_additional_config(),
            disable_log_stats=True,
            kv_transfer_config=self._kv_transfer_config(),
            shutdown_timeout=math.ceil(self.drain_timeout_s),
            worker_extension_cls=WORKER_EXTENSION_CLS,
        )
        if self._stop_asked:
            raise RuntimeError("the engine's start was stopped")
        # vLLM's engine process heeds a signal only once its model has loaded (20 s, or 1 to
        # 3 minutes while torch compiles), and its start blocks the event loop until then:
        # once a stop is asked for, its processes are killed and the load fails at once.
        threading.Thread(target=self._kill_engine_once_stopped, name="antiphon-stop-start",
                         daemon=True).start()
        use_spawned_engine()
        self._rpc_dir = use_private_rpc_dir()
        try:
            self._llm = AsyncLLM.from_engine_args(args)  # blocks until the model has loaded
        except BaseException:
            remove_rpc_dir(self._rpc_dir)
            raise
        self.vocab_size = self._llm.model_config.get_vocab_size()
        if self._llm.vllm_config.parallel_config.distributed_executor_backend == "mp":
            # workers in processes of their own: they stop with the engine, not on a signal
            await self._llm.collective_rpc("antiphon_hold_group_signals")

    def stop_starting(self) -> None:
        """Ends the start: before vLLM's engine starts, or by killing its processes while
        they load the model (`_kill_engine_once_stopped`). Nothing runs in them yet, and the
        next start removes what they leave in shared memory."""
        self._stop_asked = True

    def _kill_engine_once_stopped(self) -> None:
        """While vLLM's engine starts: once a stop is asked for, kill its processes, and
        those started after."""
        while self._loading:
            if self._stop_asked:
                kill_engine_processes()
            time.sleep(0.1)

    def _kv_transfer_config(self) -> Any:
        if self.tiering is None:
            return None
        from vllm.config import KVTransferConfig

        from antiphon.tiering.connector import kv_transfer_config

        return KVTransferConfig(**kv_transfer_config(self.tiering, self._tier_model_id))

    @functools.cached_property
    def _tier_model_id(self) -> str:
        """What separates stored KV: anything that changes its bytes, the weights (the folder,
        and `weights_fingerprint`, read once: a model changed while serving is not seen until
        the next start, as vLLM's loaded weights are not) and the dtype; the connector adds
        vLLM's KV layout, block size and KV dtype (`tiering.connector.kv_model_id`)."""
        from antiphon.model import weights_fingerprint

        return f"{self.model_dir.resolve()}|{self.dtype}|{weights_fingerprint(self.model_dir)}"

    def load_tokenizer(self) -> None:
        """The model's tokenizer, for rendering and counting (`start` loads it too)."""
        self._tokenizer = ChatTokenizer(self.model_dir)
        self.special_token_ids = self._tokenizer.special_token_ids
        self.sampling_defaults = model_sampling_defaults(self.model_dir)

    @property
    def tokenizer(self) -> ChatTokenizer:
        if self._tokenizer is None:
            raise RuntimeError("the engine's tokenizer is not loaded (start or load_tokenizer)")
        return self._tokenizer

    def render_chat(self, turns: Sequence[ChatTurn], *, open_reply: bool = True,
                    tools: Sequence[ToolSpec] = ()) -> list[int]:
        return self.tokenizer.render_chat(turns, open_reply=open_reply, tools=tools)

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count_tokens(text)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode_prompt(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return self.tokenizer.token_strings(token_ids)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: GenerationParams
    ) -> AsyncGenerator[Delta, None]:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError

        try:
            sampling = SamplingParams(
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                min_p=params.min_p,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                repetition_penalty=params.repetition_penalty,
                min_tokens=params.min_tokens,
                stop=list(params.stop) or None,
                skip_special_tokens=not (params.keep_tool_tags
                                         and self.tokenizer.tool_tags_are_special),
                seed=vllm_seed(params.seed),
                ignore_eos=params.ignore_eos,
                output_kind=RequestOutputKind.DELTA,
                extra_args=_extra_args(params),
                structured_outputs=(None if params.json_schema is None else
                                    StructuredOutputsParams(json=params.json_schema)),
                logprobs=params.logprobs,
                prompt_logprobs=params.prompt_logprobs,
                logit_bias=dict(params.logit_bias) or None,
            )
        except (VLLMClientError, ValueError) as exc:  # vLLM's own checks of the parameters
            raise EngineRequestError(str(exc)) from exc
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
        if params.cache_salt is not None:
            prompt["cache_salt"] = params.cache_salt
        stream = self._llm.generate(
            prompt,
            sampling,
            request_id,
            priority=_PRIORITY[params.request_class],
        )
        failed_as = None
        try:
            async with aclosing(stream):
                async for out in stream:
                    completion = out.outputs[0]
                    if out.finished and completion.finish_reason in FAILED_FINISH_REASONS:
                        failed_as = completion.finish_reason
                        break
                    yield Delta(
                        text=completion.text,
                        num_new_tokens=len(completion.token_ids),
                        finished=out.finished,
                        finish_reason=completion.finish_reason,
                        num_prompt_tokens=len(out.prompt_token_ids or ()),
                        num_cached_tokens=out.num_cached_tokens or 0,
                        tier_tokens=_tier_tokens(out),
                        token_ids=tuple(completion.token_ids),
                        logprobs=token_logprobs(completion, params, out.finished),
                        prompt_logprobs=prompt_logprobs(out, params.prompt_logprobs),
                    )
        except VllmDeadError as exc:
            raise EngineDeadError(str(exc)) from exc
        except (VLLMClientError, ValueError) as exc:  # the request was invalid
            raise EngineRequestError(str(exc)) from exc
        except Exception as exc:  # vLLM's EngineGenerateError: this request failed
            # vLLM aborts a failed request only once it was fully added; one that failed on
            # its way to the engine core would stay unfinished for good.
            await self._llm.abort(request_id)
            cause = exc.__cause__ or exc
            logger.error("request %s failed in the engine: %s: %s", request_id,
                         type(cause).__name__, cause)
            # (the cause's own text is the server's internals: the log has it, not the client)
            raise EngineRequestFailedError(f"an internal error ({type(cause).__name__}; the "
                                           "server's log has the rest)") from exc
        if failed_as == "error" and params.json_schema is not None:
            raise EngineRequestError(SCHEMA_ERROR)
        if failed_as is not None:
            raise EngineRequestFailedError(FAILED_FINISH_REASONS[failed_as])

    @property
    def is_dead(self) -> bool:
        return self._llm is not None and bool(self._llm.errored)

    async def health(self) -> EngineHealth:
        if self._llm is None:
            return EngineHealth(False, self.model_name, detail="not started")
        try:
            await self._llm.check_health()
        except Exception as exc:
            return EngineHealth(False, self.model_name, detail=f"{type(exc).__name__}: {exc}")
        return EngineHealth(True, self.model_name, self._llm.get_num_unfinished_requests())

    async def scheduler_stats(self) -> dict[str, Any]:
        """Counters of the scheduler in the EngineCore process (steps, time, preemptions,
        recomputed tokens per class, cost-model error)."""
        if self._llm is None:
            return {}
        return dict(await self._llm.engine_core.call_utility_async("antiphon_scheduler_stats"))

    async def advise(self, session_id: str, context_token_ids: list[int],
                     expected_arrival_s: float | None,
                     cache_salt: str | None = None, priority: int = 0) -> int | None:
        if self._llm is None or self.tiering is None:
            return None
        held = await self._llm.engine_core.call_utility_async(
            "antiphon_advise", session_id, context_token_ids, expected_arrival_s, cache_salt,
            priority)
        return None if held < 0 else int(held)

    async def forget(self, session_id: str, chains: Sequence[Sequence[int]],
                     cache_salt: str | None = None,
                     keep: Sequence[Sequence[int]] | None = None) -> int | None:
        if self._tiering_off is not None and (path := unopened_ssd_file(self._tiering_off)):
            raise unopened_file_error(path)  # KV tiering is off, and its SSD file left over
        if self._llm is None or self.tiering is None:
            return None
        core = self._llm.engine_core
        if not await core.call_utility_async(
                "antiphon_forget", session_id, [list(chain) for chain in chains], cache_salt,
                None if keep is None else [list(chain) for chain in keep]):
            return None
        deadline = time.monotonic() + FORGET_TIMEOUT_S
        while (erased := await core.call_utility_async("antiphon_forgotten", session_id)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the erasure of session {session_id}'s KV did not finish "
                                   f"in {FORGET_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.05)
        return int(erased)

    async def forget_profiling(self, chains: Sequence[Sequence[int]]) -> None:
        """Clear what profiling at start left (`chains`, the tokens of its requests): its KV
        in the tiers and vLLM's page cache, and its share of the scheduler's and the tiers'
        counters, so that served traffic starts from clean ones. Best effort: logged."""
        try:
            await self.forget(PROFILING_SESSION, chains)
            await self.reset_prefix_cache()
            await self._llm.engine_core.call_utility_async("antiphon_reset_counters")
        except Exception:
            logger.exception("what profiling left in the engine could not be cleared")

    async def tiering_stats(self) -> dict[str, Any]:
        if self._llm is None or self.tiering is None:
            return {}
        return dict(await self._llm.engine_core.call_utility_async("antiphon_tiering_stats"))

    async def check_integrity(self) -> list[str]:
        """The bidirectional-block invariants checked in the EngineCore process now (page
        ownership and direction, the preemption table against the KV tiers): the problems."""
        if self._llm is None:
            return []
        return list(await self._llm.engine_core.call_utility_async("antiphon_check_integrity"))

    def cost_model_key(self) -> tuple[str, Machine]:
        """(model, machine) a cost-model fit is stored under: the resolved model folder and its
        weights (`weights_fingerprint`: new weights in the folder are profiled again), and
        this machine and engine build (`costfit.machine_fingerprint`)."""
        from vllm.platforms import current_platform

        from antiphon.model import weights_fingerprint

        device = "cpu" if current_platform.is_cpu() else current_platform.get_device_name()
        model = f"{self.model_dir.resolve()}|{weights_fingerprint(self.model_dir)}"
        return model, machine_fingerprint(
            self.dtype, self.config.enforce_eager, device, self.config.cpu_reserved_cores,
            self.config.cpu_omp_spin_count)

    def limits(self) -> EngineLimits:
        """What the running engine can hold in one step and in its KV pool (for profiling)."""
        cache = self._llm.vllm_config.cache_config
        return EngineLimits(
            max_num_seqs=self.config.max_num_seqs,
            max_num_tokens=max(self.config.max_num_batched_tokens, self.max_model_len),
            max_model_len=self.max_model_len, kv_tokens=cache.num_gpu_blocks * cache.block_size,
            page_tokens=cache.block_size)

    async def use_cost_model(self, form: str, coefficients: Sequence[float],
                             profiled_mape: float | None = None) -> None:
        """The scheduler predicts with `form` and `coefficients` (a profiled fit, whose
        held-out MAPE it reports) from now on, refitting online from them."""
        await self._llm.engine_core.call_utility_async(
            "antiphon_use_cost_model", form, list(coefficients), profiled_mape)

    async def recorded_steps(self, record: bool) -> list[list[float]]:
        """Steps the scheduler measured since the last call, each [*StepShape fields,
        latency (s)]; it records from now on when `record`, else stops."""
        return list(await self._llm.engine_core.call_utility_async(
            "antiphon_recorded_steps", record))

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached page of the device KV pool (not the host and SSD tiers): the next
        turns find their KV only in the tiers. False when running requests hold pages."""
        return bool(await self._llm.reset_prefix_cache())

    async def set_policy(self, name: str) -> None:
        """Switch the scheduler's policy between steps; unknown names raise ValueError."""
        policy_class(name)
        await self._llm.engine_core.call_utility_async("antiphon_set_policy", name)

    async def shutdown(self) -> None:
        if self._llm is not None:
            # Abort what the server no longer waits for (replies cut at the drain's end, batch
            # items stopped): the engine process would otherwise run them on, as it drains
            # after a signal, until vLLM's process manager kills it.
            # (vLLM's own ids, which its output processor keys them by: the ids given to
            # `generate` carry a random suffix there, and aborted by those, none stopped)
            unfinished = list(self._llm.output_processor.request_states)
            if unfinished:
                with contextlib.suppress(Exception):  # a dead engine has nothing to abort
                    await self._llm.abort(unfinished, internal=True)
            engines = engine_process_ids()
            # vLLM's default grace (5 s) is shorter than its worker takes to exit here (about
            # 4 s, then the engine core's teardown): every stop ended in a force kill.
            self._llm.shutdown(timeout=ENGINE_STOP_TIMEOUT_S)
            self._llm = None
            remove_rpc_dir(self._rpc_dir)
            if self.tiering is not None:  # the host tier's arena, which the engine left
                from antiphon.tiering.host_arena import remove_arenas_of

                remove_arenas_of(engines)


def vllm_seed(seed: int | None) -> int | None:
    """`seed` as vLLM takes it: vLLM reads -1 as no seed (a reply that does not repeat), so -1
    goes as 2**64 - 1, the seed torch's generator makes of -1 (a choice's seed + offset
    wraps onto -1 too)."""
    return 2**64 - 1 if seed == -1 else seed
