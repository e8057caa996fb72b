"""Build vLLM's real objects offline: config, KV layout, scheduler, worker connector, queue.

No hub download: a small HF MoE ``config.json`` is written to a temp dir and the
tokenizer is skipped. vLLM refuses R3 on CPU only because its GPU model runner (V2)
needs Triton; that runner is exactly what the simulator stands in, so the config is
validated with R3 off and R3 is switched on afterwards, as the scheduler and the
worker connector read it at construction.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from prime_r3.bench.workload import BenchConfig


def write_model_dir(cfg: BenchConfig, directory: str) -> str:
    """A Mixtral-shaped config with the requested MoE routing shape."""
    hf = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": cfg.layers,
        "num_local_experts": cfg.experts,
        "num_experts_per_tok": cfg.topk,
        "vocab_size": cfg.vocab,
        "max_position_embeddings": 1 << 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f)
    return directory


def build_vllm_config(cfg: BenchConfig, r3: bool) -> Any:
    """VllmConfig for the run: prefix caching, chunked prefill, optional async scheduling."""
    from vllm.engine.arg_utils import EngineArgs

    # The model directory only holds the config vLLM reads while building its config;
    # removed afterwards, so a bench run (one per arm and round) leaves nothing in /tmp.
    with tempfile.TemporaryDirectory(prefix="prime_r3_bench_") as directory:
        args = EngineArgs(
            model=write_model_dir(cfg, directory),
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_num_seqs=max(cfg.concurrency, 8),
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            block_size=cfg.block_size,
            max_model_len=cfg.prompt_len + cfg.max_tokens + cfg.block_size,
            load_format="dummy",
            dtype="bfloat16",
        )
        vllm_config = args.create_engine_config()
    # The CPU platform turns async scheduling off for its own runner; ours is simulated.
    vllm_config.scheduler_config.async_scheduling = cfg.async_scheduling
    vllm_config.aux_output_config.enable_return_routed_experts = r3
    vllm_config.cache_config.num_gpu_blocks = cfg.num_kv_blocks
    return vllm_config


def build_kv_cache_config(cfg: BenchConfig) -> Any:
    """One full-attention group with ``num_kv_blocks`` blocks (small enough to fill)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=cfg.block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )
    return KVCacheConfig(
        num_blocks=cfg.num_kv_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )


def build_scheduler(vllm_config: Any, kv_cache_config: Any) -> Any:
    """vLLM's real scheduler, built the way EngineCore builds it."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.structured_output import StructuredOutputManager

    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        include_finished_set=False,
        log_stats=True,
        block_size=block_size,
        hash_block_size=hash_block_size,
    )


class CapturerStandIn:
    """Stands in for the GPU ``RoutedExpertsCapturer``: same profile, CPU snapshots.

    The model stand-in writes one step's rows with :meth:`load`; ``snapshot`` hands a
    fresh tensor per step (the real snapshot is a dtype-converting copy, so an
    in-flight step never aliases the next one).
    """

    def __init__(self, max_num_batched_tokens: int, vllm_config: Any) -> None:
        model_config = vllm_config.model_config
        num_experts = model_config.get_num_experts()
        self.shape_per_token = (
            model_config.get_total_num_hidden_layers(),
            model_config.get_num_experts_per_tok(),
        )
        self.output_dtype_name = "uint8" if num_experts <= 256 else "uint16"
        self.max_num_batched_tokens = max_num_batched_tokens
        self._rows: np.ndarray | None = None

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:  # pragma: no cover
        raise AssertionError("the simulated model does not run MoE layers")

    def load(self, rows: np.ndarray) -> None:
        self._rows = rows

    def snapshot_routing_data(self, num_tokens: int) -> torch.Tensor:
        assert self._rows is not None and len(self._rows) >= num_tokens
        rows, self._rows = self._rows, None
        return torch.from_numpy(rows[:num_tokens])


class _RouterLayer(torch.nn.Module):
    """The one "MoE router" the real ``bind_routed_experts_capturer`` binds to."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_id = 0
        self.capture_fn = None


@contextlib.contextmanager
def _worker_stand_ins(capturer_cls: type) -> Iterator[None]:
    """Swap the capturer class and the TP group into ``worker``'s namespace, then restore."""
    from vllm.distributed.aux_output_connector import worker

    saved = worker.RoutedExpertsCapturer, worker.get_tp_group
    first_rank = SimpleNamespace(is_first_rank=True)
    worker.RoutedExpertsCapturer = capturer_cls  # type: ignore[misc]
    worker.get_tp_group = lambda: first_rank  # type: ignore[assignment]
    try:
        yield
    finally:
        worker.RoutedExpertsCapturer, worker.get_tp_group = saved


def build_worker_connector(vllm_config: Any, kv_cache_config: Any) -> Any:
    """vLLM's real ``AuxOutputWorkerConnector`` via its real constructor (store sizing too)."""
    from vllm.distributed.aux_output_connector import worker

    with _worker_stand_ins(CapturerStandIn):
        connector = worker.AuxOutputWorkerConnector(
            vllm_config=vllm_config, model=_RouterLayer(), kv_cache_config=kv_cache_config
        )
    assert isinstance(connector._capturer, CapturerStandIn)
    return connector


def _zmq_sockets(mq: Any) -> list[Any]:
    """The zmq sockets a ``MessageQueue`` holds (its own and its spin condition's)."""
    spin = getattr(mq, "_spin_condition", None)
    held = [getattr(mq, "local_socket", None), getattr(mq, "remote_socket", None)]
    held += [
        getattr(spin, name, None)
        for name in ("local_notify_socket", "read_cancel_socket", "write_cancel_socket")
    ]
    return [socket for socket in held if socket is not None]


def _close_zmq(mq: Any) -> None:
    """Close a ``MessageQueue``'s zmq sockets (linger 0) and terminate their contexts,
    as vLLM 0.32's ``_close_zmq`` does when the queue is collected."""
    sockets = _zmq_sockets(mq)
    contexts = {id(socket.context): socket.context for socket in sockets}
    for socket in sockets:
        with contextlib.suppress(Exception):
            socket.close(linger=0)
    for context in contexts.values():
        with contextlib.suppress(Exception):
            context.term()


class Transport:
    """vLLM's real ``MessageQueue`` (shared-memory ring), writer and reader in one process.

    The worker enqueues ``(SUCCESS, ModelRunnerOutput)`` exactly as ``WorkerProc``
    does; EngineCore's side dequeues it. Both pickling and unpickling are real.
    """

    def __init__(self) -> None:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        self.writer = MessageQueue(n_reader=1, n_local_reader=1)
        self.reader = MessageQueue.create_from_handle(self.writer.export_handle(), 0)
        self.writer.wait_until_ready()
        self.reader.wait_until_ready()

    def send(self, output: Any) -> Any:
        self.writer.enqueue((0, output))
        status, received = self.reader.dequeue(timeout=60)
        assert status == 0
        return received

    def close(self) -> None:
        """Shut both ends, close their zmq sockets and contexts, and release the
        shared-memory ring now, not at interpreter exit.

        The sockets and contexts are closed here, not left to garbage collection:
        pyzmq's ``Context.__del__`` blocks forever in ``term()`` when a context and its
        still-open sockets are collected in the same cycle (e.g. held by a kept
        traceback), which hung a later ``gc.collect()`` on vLLM 0.31.0. vLLM 0.32
        added a finalizer for it (``MessageQueue._close_zmq_on_collect``); 0.31 has
        none. Closing twice is a no-op in pyzmq, so that finalizer finds them closed.
        """
        for mq in (self.reader, self.writer):
            with contextlib.suppress(Exception):
                mq.shutdown()
        for mq in (self.reader, self.writer):
            _close_zmq(mq)
        for mq in (self.reader, self.writer):
            ring = getattr(mq, "buffer", None)
            shm = getattr(ring, "shared_memory", None)
            if shm is None:
                continue
            with contextlib.suppress(Exception):
                shm.close()
            if ring.is_creator:
                with contextlib.suppress(FileNotFoundError):
                    shm.unlink()
            del ring.shared_memory  # so ShmRingBuffer.__del__ does not unlink twice
