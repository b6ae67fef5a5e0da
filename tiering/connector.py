"""Antiphon's vLLM KV connector: session KV in host and SSD tiers, loaded layer by layer.

vLLM loads it by name (`kv_connector="AntiphonKVConnector"`,
`kv_connector_module_path="antiphon.tiering.connector"`) and creates it twice: in the EngineCore
process with the scheduler role (`TierPlanner`: lookups, slot plans, advisories, the tier store)
and in the worker process with the worker role (`KvPageCopier`: the page copies). This class only
translates vLLM's calls into theirs. `kv_connector_extra_config` carries the `TieringConfig`
(`connector_extra_config` builds it).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from antiphon.engine_ext.types import TIER_TOKENS_KEY, RequestClass
from antiphon.tiering.config import TieringConfig
from antiphon.tiering.connector_meta import TieringMetadata, TieringWorkerMetadata
from antiphon.tiering.connector_worker import KvPageCopier
from antiphon.tiering.keys import salt_bytes
from antiphon.tiering.planner import TierPlanner, TokenView

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

CONNECTOR_NAME = "AntiphonKVConnector"
CONNECTOR_MODULE = "antiphon.tiering.connector"


def connector_extra_config(config: TieringConfig, model_id: str) -> dict[str, Any]:
    """What `kv_connector_extra_config` must hold for this connector (JSON-safe)."""
    fields = dataclasses.asdict(config)
    fields["ssd_dir"] = None if config.ssd_dir is None else str(config.ssd_dir)
    return {"antiphon_tiering": fields, "antiphon_model_id": model_id}


def kv_transfer_config(config: TieringConfig, model_id: str) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` that installs this connector."""
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            # A failed load fails the requests reading its pages, which vLLM then drops from
            # its prefix cache. Not "recompute": that leaves them there, stale, for a request
            # sharing the prefix (a retry of a cancelled turn) to read, and vLLM 0.32's
            # recompute does not roll back async scheduling's token in flight.
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": connector_extra_config(config, model_id)}


def kv_model_id(model_id: str, vllm_config: VllmConfig) -> str:
    """The identity stored KV is keyed by: the served model's (`model_id`: weights and dtype),
    and how vLLM lays the KV bytes out, known once the engine has resolved it: the KV cache
    layout, the page's tokens (vLLM's block size) and the KV dtype. KV stored under another
    layout has the same size and other bytes (a CPU engine's 128-token pages against a GPU's
    16-token ones; `VLLM_KV_CACHE_LAYOUT` changed), so it must not be found."""
    cache = vllm_config.cache_config
    return f"{model_id}|{cache.kv_cache_layout}|{cache.block_size}|{cache.cache_dtype}"


def _extra_args(request: Request) -> dict[str, Any]:
    """What the engine put in the request's `sampling_params.extra_args`."""
    extra = request.sampling_params.extra_args if request.sampling_params else None
    return extra or {}


def session_of(request: Request) -> str | None:
    """The chat session a request belongs to (the server puts it in `extra_args`)."""
    session = _extra_args(request).get("antiphon_session")
    return session if isinstance(session, str) else None


def _token_view(request: Request) -> TokenView:
    salt = salt_bytes(getattr(request, "cache_salt", None))
    background = RequestClass.of_extra_args(_extra_args(request)) is RequestClass.BE
    return TokenView(request.request_id, request.all_token_ids, session_of(request), salt,
                     background=background)


def check_supported(world_size: int, kv_cache_config: KVCacheConfig) -> None:
    """Raises ValueError unless the engine is one worker over a model with full attention in
    every layer. Sliding-window layers (one group of them alone) hand vLLM's null page in place
    of the pages that left the window: a late save or checkpoint would store its bytes under
    a valid key, and a later prompt sharing that prefix would load them."""
    if world_size != 1:
        raise ValueError("Antiphon's KV tiering supports one worker (no tensor or pipeline "
                         "parallelism) in this version")
    groups = kv_cache_config.kv_cache_groups
    # (exact types: subclasses such as R-SWA's evict pages too; MLA's latent pages copy as
    # any other, block first)
    if len(groups) != 1 or type(groups[0].kv_cache_spec) not in (FullAttentionSpec,
                                                                   MLAAttentionSpec):
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise ValueError("Antiphon's KV tiering needs a model with one KV cache group of full "
                         f"attention in every layer (this one: {len(groups)} of "
                         f"{', '.join(kinds)}); serve it with --no-kv-tiering")


class AntiphonKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_supported(vllm_config.parallel_config.world_size, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        fields = dict(extra["antiphon_tiering"])
        fields["ssd_dir"] = Path(fields["ssd_dir"]) if fields["ssd_dir"] else None
        block_size = vllm_config.cache_config.block_size
        chunk_tokens = max(block_size, fields["chunk_tokens"] // block_size * block_size)
        config = TieringConfig(**{**fields, "page_tokens": block_size,
                                  "chunk_tokens": chunk_tokens})
        group = kv_cache_config.kv_cache_groups[0]
        self._layer_names = list(group.layer_names)
        self._planner: TierPlanner | None = None
        self._copier: KvPageCopier | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._planner = TierPlanner(
                config, model_id=kv_model_id(str(extra["antiphon_model_id"]), vllm_config),
                num_layers=len(self._layer_names),
                page_bytes=group.kv_cache_spec.page_size_bytes,
                block_ids_of=self._block_ids_of)
            log.info("KV tiering on: %s; host arena %s", [t.name for t in
                                                           self._planner.store.tiers],
                     self._planner.arena_name)
        else:
            self._copier = KvPageCopier(self._layer_names, copy_mode=config.kv_copy_mode,
                                        staging_pages=config.kv_copy_staging_pages)

    # -- scheduler side ----------------------------------------------------------------------

    @property
    def planner(self) -> TierPlanner:
        assert self._planner is not None, "scheduler-side call on the worker connector"
        return self._planner

    def _block_ids_of(self, request_id: str) -> list[int]:
        assert self._kv_cache_manager is not None
        return list(self._kv_cache_manager.get_block_ids(request_id)[0])

    def on_new_request(self, request: Request) -> None:
        self.planner.add_request(_token_view(request))

    def stored_prefix_tokens(self, request: Request) -> int:
        """Prompt tokens of a waiting request its admission will find in the tiers (estimate)."""
        return self.planner.stored_prefix_tokens(_token_view(request))

    def checkpoint(self, request: Request) -> int:
        """The running request is being preempted: keep its KV in the tiers (lazy
        checkpointing); returns the computed tokens they will hold."""
        return self.planner.checkpoint(request.request_id, request.num_computed_tokens,
                                       self._block_ids_of(request.request_id))

    def checkpoint_cost_pages(self, request: Request) -> int:
        """Pages preempting the running request now would copy to the host tier."""
        return self.planner.checkpoint_cost_pages(request.request_id,
                                                  request.num_computed_tokens)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.skip_reading_prefix_cache:
            # vLLM reads no cached KV for it (prompt logprobs) and sets the answer to 0: a
            # match would start SSD fetches it never loads, holding host slots meanwhile
            self.planner.admit_without_match(_token_view(request))
            return 0, False
        return self.planner.num_new_matched_tokens(_token_view(request), num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.planner.plan_load(request.request_id, blocks.get_block_ids()[0],
                               num_external_tokens, request.num_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        done: list[tuple[str, int]] = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            done.append((new.req_id, new.num_computed_tokens + num_scheduled[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            done.append((request_id, cached.num_computed_tokens[index]
                         + num_scheduled[request_id]))
        return self.planner.build_metadata(done)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, TieringWorkerMetadata):
            self.planner.step_done(meta.done_steps, meta.failed_steps)

    def has_pending_push_work(self) -> bool:
        # The worker reports a step's copies done in a later step's output (asynchronous on
        # CUDA): an engine gone idle must step on, empty steps, until it has, or the last
        # step's load pins and saves would wait for the next request.
        return self.planner.has_steps_in_flight()

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Where its prompt's stored KV came from rides out with the request's last output
        # (vLLM's `kv_transfer_params`): per turn, what the tiers served (`TIER_TOKENS_KEY`).
        loads = self.planner.served_from(request.request_id)
        delay = self.planner.request_finished(request.request_id,
                                              request.num_computed_tokens, block_ids)
        return delay, (None if loads is None else {TIER_TOKENS_KEY: list(loads)})

    # -- worker side -------------------------------------------------------------------------

    @property
    def copier(self) -> KvPageCopier:
        assert self._copier is not None, "worker-side call on the scheduler connector"
        return self._copier

    def has_connector_metadata(self) -> bool:
        # vLLM asks this around every attention layer, and calls `wait_for_layer_load` and
        # `save_kv_layer` there only when it is true: a step that moves no KV layer by layer
        # skips both calls in every layer (with them, a lone decode step took 16.1 ms on 2
        # cores against 15.6 without tiering). Our own calls ask `_bound_meta`.
        meta = self._bound_meta()
        return meta is not None and meta.has_layer_work

    def _bound_meta(self) -> TieringMetadata | None:
        """This step's metadata, or None outside a step (`_get_connector_metadata` asserts)."""
        meta = self._connector_metadata
        assert meta is None or isinstance(meta, TieringMetadata)
        return meta

    def _meta(self) -> TieringMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieringMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.copier.register(kv_caches)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Loads and saves run between layers (`wait_for_layer_load`, `save_kv_layer`): a
        # full CUDA graph would replay the layers without them.
        return True

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Before the forward pass, always: vLLM starts `start_load_kv` after the forward in
        # steps where no request loads stored KV, and a preempted request's pages may be
        # written over by this step's forward.
        assert isinstance(kv_connector_metadata, TieringMetadata)
        self.copier.checkpoint(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Whole matched pages load layer by layer (`wait_for_layer_load`, just before each
        # layer's attention); a partly matched page must land before any layer writes into
        # it. vLLM calls this before the forward pass whenever a request loads stored KV.
        self.copier.load_early(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.copier.load_layer(self._meta(), layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        self.copier.save_layer(self._meta(), layer_name)

    def wait_for_save(self) -> None:
        meta = self._bound_meta()
        if meta is not None:
            self.copier.finish_step(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.copier.take_finished_sending() or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.copier.take_invalid_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.copier.take_worker_meta()

    def shutdown(self) -> None:
        if self._copier is not None:
            self._copier.close()
        if self._planner is not None:
            self._planner.close()
