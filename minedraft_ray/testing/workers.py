"""Worker actors for tests and benchmarks only: subclasses of the runtime's workers that inject drafter faults,
replace rejection sampling by a synthetic acceptance rate, or record what each verify saw.

They reach an engine only through `LLM(..., _workers=...)` (a `WorkerSet`, which names them by import path); the
HTTP server builds its engine from an EngineConfig alone, so no request can turn any of this on. Their own methods
are reached through the actor's `worker` (runtime/actors.py: the actor hands the manager's calls to it).
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.sampling import noise_uniform
from ..engine.spec import Verifier
from ..runtime.actors import WorkerSet, class_path
from ..runtime.workers import DrafterWorker, SpecWorker, VerifierWorker
from .faults import DrafterFaults

# the noise stream of the synthetic acceptance draws (the engine's streams are numbered 1..4, sampling.py)
PURPOSE_SYNTHETIC = 17


# ---- drafter faults ----------------------------------------------------------------------------------
class _FaultyDrafter:
    """The engine's Drafter, with faults before a round's device work (inside the worker's launch turn)."""

    def __init__(self, drafter, faults: DrafterFaults):
        self._drafter, self.faults, self.rounds = drafter, faults, 0

    def __getattr__(self, name):
        return getattr(self._drafter, name)

    def prefill(self, *args, **kwargs):
        time.sleep(self.faults.prefill_delay_s)
        return self._drafter.prefill(*args, **kwargs)

    def draft(self, *args, **kwargs):
        if self.faults.delay_s:
            time.sleep(self.faults.delay_s)
        self.rounds += 1
        if self.rounds == self.faults.error_at:
            raise RuntimeError(f"draft round {self.rounds} failed (injected)")
        if self.rounds == self.faults.hang_at:
            time.sleep(3600)
        return self._drafter.draft(*args, **kwargs)


class FaultyDrafterWorker(DrafterWorker):
    def __init__(self, config: dict, num_slots: int, faults: DrafterFaults = DrafterFaults()):
        super().__init__(config, num_slots)
        self.drafter = _FaultyDrafter(self.drafter, faults)

    def set_faults(self, faults: DrafterFaults) -> None:
        """New faults, its rounds numbered from 1 again (an idle drafter: between two tests on one engine)."""
        self.drafter.faults, self.drafter.rounds = faults, 0


def faulty_drafter(**faults) -> WorkerSet:
    """LLM(..., _workers=faulty_drafter(error_at=4)): the drafter's rounds fail as DrafterFaults says."""
    return WorkerSet(drafter=class_path(FaultyDrafterWorker), drafter_kwargs={"faults": DrafterFaults(**faults)})


def set_drafter_faults(llm, **faults) -> None:
    """The running drafter of an idle LLM started with faulty_drafter() takes these faults, counting its rounds from
    now; a drafter the engine starts later (a restart) has the faults the LLM was started with."""
    import ray

    new = DrafterFaults(**faults)

    def set_faults(actor):
        return actor.manager.drafter.__ray_call__.remote(lambda drafter: drafter.worker.set_faults(new))
    ray.get(ray.get(llm.manager.__ray_call__.remote(set_faults)))


# ---- synthetic acceptance (benchmarks) ---------------------------------------------------------------
class SyntheticVerifier(Verifier):
    """Random-weight pairs accept next to nothing, so benchmarks set the acceptance: draft j is accepted while
    u(seed, position + j) < alpha, then one target (argmax) token follows. The draws are keyed by (request
    seed, output position), so every mode sees the same ones."""

    def __init__(self, runner, alpha: float):
        super().__init__(runner)
        self.alpha = alpha

    def accept(self, logits, draft_ids, num_drafts, batch, positions, draft_probs):
        k = draft_ids.shape[1]
        if k == 0:
            return super().accept(logits, draft_ids, num_drafts, batch, positions, draft_probs)
        j = torch.arange(k + 1, device=self.device)                                   # [k+1]
        u = noise_uniform(batch.seed, positions[:, None] + j[:k], PURPOSE_SYNTHETIC)   # [B, k]
        accepted = ((u < self.alpha) & (j[:k] < num_drafts[:, None])).long().cumprod(1).sum(1)
        target = logits.argmax(-1)                                                   # [B, k+1]
        drafts = torch.cat([draft_ids, target[:, -1:]], 1)                           # [B, k+1]
        tokens = torch.where(j < accepted[:, None], drafts, target)
        tokens = torch.where(j <= accepted[:, None], tokens, -1)
        return tokens, accepted + 1


class SyntheticVerifierWorker(VerifierWorker):
    def __init__(self, config: dict, num_slots: int, acceptance: float = 0.8, **group):
        super().__init__(config, num_slots, **group)
        self.verifier = SyntheticVerifier(self.verifier.runner, acceptance)

    def set_acceptance(self, alpha: float) -> None:
        self.verifier.alpha = alpha


class SyntheticSpecWorker(SpecWorker):
    def __init__(self, config: dict, num_slots: int, acceptance: float = 0.8, **group):
        super().__init__(config, num_slots, **group)
        self.verifier = SyntheticVerifier(self.verifier.runner, acceptance)

    def set_acceptance(self, alpha: float) -> None:
        self.verifier.alpha = alpha


def synthetic_acceptance(alpha: float) -> WorkerSet:
    """LLM(..., _workers=synthetic_acceptance(0.8)): every mode's verifier accepts drafts at rate alpha."""
    return WorkerSet(verifier=class_path(SyntheticVerifierWorker), spec=class_path(SyntheticSpecWorker),
                     verifier_kwargs={"acceptance": alpha})


def set_synthetic_acceptance(llm, alpha: float) -> None:
    """A new alpha for an idle LLM started with synthetic_acceptance (same actors, models and graphs)."""
    import ray

    def set_alpha(actor):
        return actor.manager.verifier.__ray_call__.remote(lambda verifier: verifier.worker.set_acceptance(alpha))
    ray.get(ray.get(llm.manager.__ray_call__.remote(set_alpha)))


# ---- prompt tokens that cost time (the adaptive chunk) ----------------------------------------------------
class _SlowPrompts:
    """Each prompt token a launch carries (a prefill, or chunks fused into a verify) adds ms_per_token to it,
    inside its step's timer: a CPU's tiny models, whose steps are mostly fixed costs, priced like a GPU's, where a
    chunk of a few hundred tokens takes a decode step's time again."""
    ms_per_token: float

    def _prefill_beside(self, rows) -> None:
        super()._prefill_beside(rows)
        time.sleep(self.ms_per_token * sum(len(r.tokens) for r in rows) / 1e3)


class SlowPromptsVerifierWorker(_SlowPrompts, VerifierWorker):
    def __init__(self, config: dict, num_slots: int, ms_per_token: float = 0.0, **group):
        super().__init__(config, num_slots, **group)
        self.ms_per_token = ms_per_token


class SlowPromptsSpecWorker(_SlowPrompts, SpecWorker):
    def __init__(self, config: dict, num_slots: int, ms_per_token: float = 0.0, **group):
        super().__init__(config, num_slots, **group)
        self.ms_per_token = ms_per_token


def slow_prompts(ms_per_token: float) -> WorkerSet:
    """LLM(..., _workers=slow_prompts(0.2)): every prompt token the verifier prefills costs 0.2 ms more."""
    return WorkerSet(verifier=class_path(SlowPromptsVerifierWorker), spec=class_path(SlowPromptsSpecWorker),
                     verifier_kwargs={"ms_per_token": ms_per_token})


# ---- a worker that dies, or fails, while it starts ----------------------------------------------------
class DiesWhileStartingVerifierWorker(VerifierWorker):
    """Its process is killed (SIGKILL, as the OOM killer kills) in its constructor while the count in the file
    `deaths` is above zero, each death taking one off: a count of 1 kills the first start only. `raises`: its
    constructor raises instead (an error that would raise again)."""

    def __init__(self, config: dict, num_slots: int, deaths: str, raises: bool = False, **group):
        path = Path(deaths)
        left = int(path.read_text())
        if left > 0:
            path.write_text(str(left - 1))
            if raises:
                raise RuntimeError("the worker's constructor failed (injected)")
            os.kill(os.getpid(), signal.SIGKILL)
        super().__init__(config, num_slots, **group)


def dies_while_starting(deaths: str, raises: bool = False) -> WorkerSet:
    """LLM(..., mode="ar", _workers=dies_while_starting(path)): the verifier's process dies while it starts as
    many times as the file at `path` says (or its constructor raises, `raises`)."""
    return WorkerSet(verifier=class_path(DiesWhileStartingVerifierWorker),
                     verifier_kwargs={"deaths": deaths, "raises": raises})


# ---- recording ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VerifyRow:
    """One row of one verify as the verifier saw it."""
    slot: int
    position: int              # output position of the row's first emitted token
    drafts: tuple[int, ...]    # the draft tokens it verified (empty: none)
    emitted: tuple[int, ...]   # the tokens it emitted


class RecordingVerifier(Verifier):
    def __init__(self, runner):
        super().__init__(runner)
        self.rows: list[VerifyRow] = []

    def _accept_rows(self, logits, slots, draft_ids, num_drafts, batch, positions, draft_probs, num_logprobs):
        # every verify's rows, fused with prompt chunks or not
        result = super()._accept_rows(logits, slots, draft_ids, num_drafts, batch, positions, draft_probs,
                                      num_logprobs)
        emitted = result.num_emitted.tolist()
        for slot, pos, ids, nd, toks, n in zip(slots.tolist(), positions.tolist(), draft_ids.tolist(),
                                                num_drafts.tolist(), result.tokens.tolist(), emitted):
            self.rows.append(VerifyRow(slot, pos, tuple(ids[:nd]), tuple(toks[:n])))
        return result


class RecordingVerifierWorker(VerifierWorker):
    def __init__(self, config: dict, num_slots: int, **group):
        super().__init__(config, num_slots, **group)
        self.verifier = RecordingVerifier(self.verifier.runner)

    def verify_rows(self) -> list[VerifyRow]:
        return list(self.verifier.rows)


class RecordingSpecWorker(SpecWorker):
    def __init__(self, config: dict, num_slots: int, **group):
        super().__init__(config, num_slots, **group)
        self.verifier = RecordingVerifier(self.verifier.runner)

    def verify_rows(self) -> list[VerifyRow]:
        return list(self.verifier.rows)


def recording() -> WorkerSet:
    """LLM(..., _workers=recording()): the verifier keeps a VerifyRow per row of every verify."""
    return WorkerSet(verifier=class_path(RecordingVerifierWorker), spec=class_path(RecordingSpecWorker))


def verify_rows(llm) -> list[VerifyRow]:
    import ray

    def rows(actor):
        return actor.manager.verifier.__ray_call__.remote(lambda verifier: verifier.worker.verify_rows())
    return ray.get(ray.get(llm.manager.__ray_call__.remote(rows)))
