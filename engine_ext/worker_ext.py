"""Methods Antiphon adds to vLLM's worker class (vLLM's `worker_extension_cls`), called in every
worker with `collective_rpc`."""

from __future__ import annotations

import os
import signal

from antiphon.engine_ext.compile_cache import reuse_cpu_compiled_model
from antiphon.engine_ext.seeded_cpu import rewind_discarded_cpu_generators

# vLLM imports this module in each worker before the model compiles (or loads compiled)
reuse_cpu_compiled_model()
rewind_discarded_cpu_generators()


class AntiphonWorkerExtension:
    def antiphon_hold_group_signals(self) -> int:
        """Run on through SIGINT and SIGTERM; returns this worker's process id.

        For workers in processes of their own (vLLM's multiprocessing executor, which the CPU
        backend always uses). A signal to the server's whole process group (Ctrl-C in a
        terminal, systemd's default KillMode) reaches them too; each left at once, and the
        engine process failed the replies the server was draining. vLLM's engine process drains
        on such a signal (`shutdown_timeout`) and stops its workers itself when it is done, by
        closing the pipe each watches (or by dying); a worker has no other reason to stop."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return os.getpid()

    def antiphon_fail_kv_loads(self, steps: int) -> bool:
        """A fault drill: the KV tiers' page loads of the next `steps` steps that load any
        fail in this worker (the requests reading them fail, the engine serves on, and their
        retries answer as before). False when KV tiering is off."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        from antiphon.tiering.connector import AntiphonKVConnector

        if not has_kv_transfer_group():
            return False
        connector = get_kv_transfer_group()
        if not isinstance(connector, AntiphonKVConnector):
            return False
        connector.copier.fail_loads(steps)
        return True
