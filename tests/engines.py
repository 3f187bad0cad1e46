"""Started engines shared by the runtime test files that start the same one (one pytest worker's cache).

An engine's start (three Ray actors, each importing torch) is most of a runtime test, so the tiny `sd` and `psd`
engines that test_runtime.py, test_runtime_regimes.py and test_chunked_prefill.py each used to start for
themselves start once per worker. Those files run on one worker, one after another (tests/conftest.py makes them
one unit of `--dist loadfile`), and the cache is emptied as soon as a test of another file
starts, so that their engines do not hold the cluster's (fake) GPUs while other files run.

A test may reconfigure a shared engine (k, the prefill budget) but must leave it as it found it, idle: the next
`get` checks that and fails the test that finds it changed.
"""
from __future__ import annotations

# the files whose tests share the cache (one xdist group)
SHARING_FILES = ("test_runtime.py", "test_runtime_regimes.py", "test_chunked_prefill.py")

# sd with every streamed output sent as it comes (generate() collects outputs without the stream interval)
TINY_SD = {"mode": "sd", "k": 3, "max_batch": 3, "stream_interval_ms": 0.0}
# psd over the object store, split at every load
TINY_PSD = {"mode": "psd", "k": 3, "max_batch": 3, "psd_low_load": "psd", "psd_high_load": "psd"}

# what a test may change in place (LLM.reconfigure), as the engine's info reports it
RECONFIGURABLE = ("k", "prefill_chunk_tokens", "fused_prefill", "chunk_gap_ratio", "chunk_gap_reference")


class EngineCache:
    def __init__(self):
        self.engines: dict[tuple, tuple] = {}
        self.starts = 0

    def get(self, target, draft, **settings) -> LLM:
        """The started engine of this pair and these settings (torch_threads=1), started on first use."""
        from minedraft_ray.runtime import LLM   # imported here: tests/conftest.py imports this module before Ray's
        from runtime_common import settled
        key = (str(target), str(draft), tuple(sorted(settings.items())))
        if key not in self.engines:
            llm = LLM(target, draft, torch_threads=1, **settings)
            self.starts += 1
            self.engines[key] = (llm, {name: llm.info()[name] for name in RECONFIGURABLE})
        llm, started_as = self.engines[key]
        info = settled(llm)
        now = {name: info[name] for name in RECONFIGURABLE}
        assert now == started_as and info["running"] == info["queued"] == info["slots_in_use"] == 0, \
            f"a test left the shared engine {settings} changed or busy: {now} (started as {started_as}), {info}"
        return llm

    def close(self) -> None:
        engines, self.engines = self.engines, {}
        for llm, _ in engines.values():
            llm.shutdown()


CACHE = EngineCache()
