"""Per-request output streams: what the manager hands a caller, and how outputs are coalesced.

Each output a stream hands over costs a Ray hop per request (Serve, LLM.stream): at a step every few ms that
cost rivals the step's, so outputs within the stream interval are merged. The first output and the last one
(finished) go out at once, so TTFT and latency do not change.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    logprobs: list[dict] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stats: dict | None = None
    error: str | None = None


def _merged(a: StepOutput, b: StepOutput) -> StepOutput:
    """Two consecutive outputs of one request as one (b's finish, stats and error win)."""
    logprobs = (a.logprobs or []) + (b.logprobs or []) if a.logprobs is not None or b.logprobs is not None else None
    return StepOutput(a.request_id, a.new_token_ids + b.new_token_ids, logprobs, b.finished, b.finish_reason,
                      b.stats, b.error)


async def coalesced(queue: asyncio.Queue, interval_s: float):
    """The outputs put on `queue`, at most one per interval_s (merged meanwhile), until the finished one."""
    last = None   # when the previous output went out
    while True:
        out: StepOutput = await queue.get()
        while not out.finished:
            if not queue.empty():   # the consumer fell behind: hand over what is queued at once
                out = _merged(out, queue.get_nowait())
                continue
            wait = 0.0 if last is None else last + interval_s - time.perf_counter()
            if wait <= 0:
                break
            # not asyncio.wait_for: when the stream is cancelled just as an output arrives, it returns the
            # output and swallows the cancellation, and the request would never be aborted
            getter = asyncio.ensure_future(queue.get())
            try:
                await asyncio.wait((getter,), timeout=wait)
            finally:
                if not getter.done():
                    getter.cancel()   # an output that was on its way stays in the queue
            if not getter.done() or getter.cancelled():
                break
            out = _merged(out, getter.result())
        yield out
        last = time.perf_counter()
        if out.finished:
            return
