"""``prime-r3 bench``: vLLM's real scheduler, aux-output worker and transport, simulated model.

One module per job: ``workload`` (what is asked), ``vllm_setup`` (offline configs and
vLLM objects), ``model`` (the deterministic model stand-in), ``loop`` (the engine
step loop and its meters), ``arms`` (one spawned process per arm), ``report`` (table,
JSON, plot, parity) and ``command`` (the CLI entry).
"""
