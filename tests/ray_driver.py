"""The head of tests/test_e2e_ray.py: what EngineCore does with a Ray executor, as far as
vLLM's CPU build lets it.

Run as ``python tests/ray_driver.py MODEL OUT`` with ``RAY_ADDRESS`` naming a running Ray
cluster. It loads vLLM's general plugins (prime_r3's among them) as EngineCore does, builds
the engine's ``VllmConfig`` (tensor parallel 2, ``distributed_executor_backend="ray"``),
calls vLLM's ``initialize_ray_cluster`` (both Ray executors' first step; on the CPU
platform it raises), then starts each executor's two workers as that executor does once
its placement group is known, with vLLM's own classes and functions:

* ``v1`` (the legacy ``RayDistributedExecutor``, 0.31/0.32): ``RayWorkerWrapper``
  actors; the environment from ``get_env_vars_to_copy`` sent through
  ``update_environment_variables``; ``init_worker``, ``init_device``, ``load_model``.
* ``v2`` (``RayExecutorV2``): ``RayWorkerProc`` actors on a ``MessageQueue`` handle;
  ``create_dist_init_method``; ``initialize_worker`` with ``get_driver_env_vars``'s
  environment (the worker process's own init: device, distributed group, model);
  ``wait_for_init``.

Written to OUT as JSON: the refusal's message and each executor's worker pids.
"""

from __future__ import annotations

import json
import os
import sys


def main(model: str, out_path: str) -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import ray
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.network_utils import get_distributed_init_method, get_open_port
    from vllm.v1.executor import ray_utils

    args = EngineArgs(
        model=model, tensor_parallel_size=2, distributed_executor_backend="ray",
        enforce_eager=True, dtype="bfloat16", skip_tokenizer_init=True,
        enable_return_routed_experts=True, kv_cache_memory_bytes=2 << 20, block_size=32,
        max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256,
    )  # fmt: skip
    config = args.create_engine_config()
    out: dict[str, object] = {"ray_device_key": current_platform.ray_device_key}
    try:
        ray_utils.initialize_ray_cluster(config.parallel_config)  # connects to RAY_ADDRESS
        out["refused"] = None
    except ValueError as error:
        out["refused"] = str(error)
    if not ray.is_initialized():
        ray.init(address=os.environ["RAY_ADDRESS"])

    def pids(workers: list) -> list[int]:
        return ray.get([w.__ray_call__.remote(lambda self: os.getpid()) for w in workers])

    if hasattr(ray_utils, "RayWorkerWrapper") and _has_legacy_executor():
        from vllm.ray.ray_env import get_env_vars_to_copy

        workers = [
            ray.remote(num_cpus=0, num_gpus=0)(ray_utils.RayWorkerWrapper).remote(rpc_rank=rank)
            for rank in range(2)
        ]
        names = get_env_vars_to_copy(
            exclude_vars=ray_utils.WORKER_SPECIFIC_ENV_VARS,
            additional_vars=set(current_platform.additional_env_vars),
            destination="workers",
        )
        env = [{n: os.environ[n] for n in names if n in os.environ} for _ in workers]
        ray.get([w.update_environment_variables.remote(env) for w in workers])
        init = get_distributed_init_method("127.0.0.1", get_open_port())
        kwargs = [
            dict(
                vllm_config=config,
                local_rank=rank,
                rank=rank,
                distributed_init_method=init,
                is_driver_worker=rank == 0,
            )
            for rank in range(2)
        ]
        ray.get([w.init_worker.remote(kwargs) for w in workers])
        for method in ("init_device", "load_model"):
            ray.get([w.execute_method.remote(method) for w in workers])
        out["v1"] = pids(workers)
        for w in workers:
            ray.kill(w)

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.v1.executor.ray_env_utils import get_driver_env_vars
    from vllm.v1.executor.ray_executor_v2 import RayWorkerProc

    queue = MessageQueue(2, 2, max_chunk_bytes=1 << 20, connect_ip=ray.util.get_node_ip_address())
    workers = [
        ray.remote(RayWorkerProc)
        .options(num_cpus=0)
        .remote(
            vllm_config=config,
            rank=rank,
            input_shm_handle=queue.export_handle(),
            is_driver_worker=rank == 0,
            is_driver_node=True,
        )
        for rank in range(2)
    ]
    driver_env = get_driver_env_vars(worker_specific_vars=ray_utils.WORKER_SPECIFIC_ENV_VARS)
    init = ray.get(workers[0].create_dist_init_method.remote())
    ray.get([w.initialize_worker.remote(r, {}, init, driver_env) for r, w in enumerate(workers)])
    ray.get([w.wait_for_init.remote() for w in workers])
    out["v2"] = pids(workers)
    for w in workers:
        ray.kill(w)
    queue.shutdown()
    with open(out_path, "w") as f:
        json.dump(out, f)


def _has_legacy_executor() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm.v1.executor.ray_executor") is not None


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
