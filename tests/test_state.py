"""prime_r3.state: readers that run every step never trip over a concurrent apply/revert."""

from __future__ import annotations

import threading
import time

from prime_r3 import state


def test_readers_survive_records_changing_on_another_thread() -> None:
    """batched_commit (worker output thread) and packed_outputs (EngineCore) ask
    ``wrapped_by`` / ``unwrap_ours`` every step without the lock, while an import hook
    on another thread may apply a patch. Found by review: iterating the live dicts
    raised ``RuntimeError: dictionary changed size during iteration``."""

    def upstream() -> None:
        pass

    names = [f"test_state_p{i}" for i in range(50)]
    for i, name in enumerate(names):
        state.add_wrappers(name, {f"m:a{i}": object()}, {f"m:a{i}": None})
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                state.wrapped_by(upstream)
                state.unwrap_ours(upstream)
                state.is_object_patched(upstream)
            except RuntimeError as error:  # the failure this guards against
                errors.append(error)
                return

    thread = threading.Thread(target=reader)
    thread.start()
    deadline = time.monotonic() + 3.0
    try:
        while time.monotonic() < deadline and not errors:
            for _ in range(1000):
                with state.lock():  # as layer's apply, revert and import hooks do
                    state.add_wrappers("test_state_x", {"m:x": object()}, {"m:x": None})
                    state.forget("test_state_x")
    finally:
        stop.set()
        thread.join()
        for name in names:
            state.forget(name)
    assert errors == []
