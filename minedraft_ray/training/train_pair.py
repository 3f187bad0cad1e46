"""Train the embedded default pair: a small Llama target on the site-packages corpus and a smaller Llama
draft distilled from it, written in Hugging Face format (bf16) with their tokenizer and a report.

    python -m minedraft_ray.training.train_pair --out OUT --time-budget-s 500 [--smoke]

Stages: prep (corpus, manifest, tokenizer, token streams), target, draft. Each is checkpointed in
--ckpt-dir; a second invocation skips finished stages and continues an interrupted one. Export,
evaluation and the report are cheap and rerun every time. The time budget covers the whole invocation:
prep takes what it takes, the training stages share what is left (each runs its cosine schedule over
its share of seconds unless its step count is pinned), and a reserve is kept for evaluation and export.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import corpus

# Split like GPT-4 / Llama 3: letters with one leading non-letter, digits in groups of up to three,
# punctuation runs, and newlines apart from the indentation that follows them.
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
EOS, BOS, PAD = "<|endoftext|>", "<|startoftext|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [EOS, BOS, PAD, *ROLE_TOKENS]  # ids 0..5
# One turn: role token, newline, content, eos. The model never saw chat data, so a chat answer is a
# continuation in the style of the corpus, but the format is that of every chat model.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
                 "{{ message['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SIZE_LIMIT = 10_000_000    # bytes of the shipped pair (both folders)
FILE_LIMIT = 15_000_000    # bytes of any one shipped file
ACCEPT_GOAL = (4, 2.3)     # acceptance_length at k=4 greedy on held-out code


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int = 64


@dataclass
class Config:
    """Everything that changes the trained weights; a checkpoint only resumes under the same Config."""
    seed: int = 0
    heldout_frac: float = 0.05
    max_corpus_mb: float = 800.0        # seeded uniform file sample above this many MB of candidates
    heldout_eval_mb: float = 16.0       # held-out text tokenized for evaluation (per kind)
    tokenizer_train_mb: float = 32.0
    vocab_size: int = 4096
    seq_len: int = 512
    max_position_embeddings: int = 1024
    target: Shape = Shape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512)
    draft: Shape = Shape(hidden=128, layers=2, heads=2, kv_heads=2, intermediate=384)
    batch_size: int = 256
    target_lr: float = 3e-3
    draft_lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    distill_alpha: float = 0.9          # weight of KL(target || draft); the rest is the LM loss
    target_steps: int = 0               # 0: as many as the time budget allows
    draft_steps: int = 0
    target_share: float = 0.6           # of the training time, when both stages run in one invocation
    eval_tokens: int = 1 << 21          # per held-out stream, final evaluation
    eval_tokens_during: int = 1 << 16   # per held-out stream, evaluations during training
    evals_per_stage: int = 10
    log_every: int = 10
    accept_prompts: int = 128
    prompt_len: int = 128
    gen_len: int = 128
    max_k: int = 5


SMOKE = dict(max_corpus_mb=1.0, heldout_eval_mb=0.2, tokenizer_train_mb=1.0, vocab_size=512, seq_len=64,
             max_position_embeddings=128, heldout_frac=0.2, batch_size=8, warmup_steps=3,
             target=Shape(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, head_dim=32),
             draft=Shape(hidden=32, layers=2, heads=1, kv_heads=1, intermediate=64, head_dim=32),
             target_steps=40, draft_steps=30, eval_tokens=4096, eval_tokens_during=1024, evals_per_stage=2,
             log_every=5, accept_prompts=4, prompt_len=16, gen_len=24)


class Log:
    def __init__(self):
        self.t0 = time.time()

    def __call__(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:7.1f}s] {msg}", flush=True)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- prep

def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    # completions get a bos like training documents; chat prompts carry it in the template instead
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def hf_tokenizer(tok, max_len: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE,
                                   model_max_length=max_len)


def encode_docs(tok, texts: list[str], threads: int | None = None, chunk: int = 256) -> np.ndarray:
    """One stream of `bos doc eos` for every text, as uint16 (vocab < 65536).

    Chunks go to a thread pool: encode_batch releases the GIL, and its own parallelism was not seen to
    use more than one core.
    """
    bos, eos = np.array([tok.token_to_id(BOS)], np.uint16), np.array([tok.token_to_id(EOS)], np.uint16)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # fast: no offsets

    def run(batch: list[str]) -> list[np.ndarray]:
        parts = []
        for enc in encode(batch, add_special_tokens=False):
            parts += [bos, np.asarray(enc.ids, np.uint16), eos]
        return parts

    with ThreadPoolExecutor(threads or os.cpu_count() or 4) as pool:
        parts = [p for ps in pool.map(run, [texts[i:i + chunk] for i in range(0, len(texts), chunk)]) for p in ps]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def _take_mb(docs: list, mb: float) -> list:
    out, total = [], 0
    for d in docs:
        if total >= mb * 1e6:
            break
        out.append(d)
        total += d.bytes
    return out


def prepare(cfg: Config, prep_dir: Path, log: Log, command: str = "") -> dict:
    done = prep_dir / "prep.json"
    if done.is_file():
        log("prep: done in an earlier run, skipping")
        return json.loads(done.read_text())
    t0 = time.time()
    prep_dir.mkdir(parents=True, exist_ok=True)
    roots = corpus.site_packages_roots()
    docs, dropped = corpus.collect(roots, seed=cfg.seed, heldout_frac=cfg.heldout_frac,
                                   max_bytes=cfg.max_corpus_mb * 1e6, threads=min(32, os.cpu_count() or 4))
    corpus.write_manifest(docs, prep_dir / "manifest.jsonl.gz")
    t_collect = time.time() - t0
    # a seeded order by content: packed training windows mix packages, and samples of it are unbiased
    order = sorted(docs, key=lambda d: corpus.unit_hash(cfg.seed, "order/" + d.sha256))
    train = [d for d in order if d.split == "train"]
    held_code = [d for d in order if d.split == "heldout" and d.kind == "code"]
    held_prose = [d for d in order if d.split == "heldout" and d.kind == "prose"]
    if not train or not held_code:
        raise SystemExit(f"corpus too small: {len(train)} training and {len(held_code)} held-out code files "
                         f"under {', '.join(map(str, roots))}")
    log(f"prep: {len(docs)} files ({sum(d.bytes for d in docs) / 1e6:.1f} MB) from {', '.join(map(str, roots))} "
        f"in {t_collect:.1f}s; dropped {dropped}")

    tok = train_tokenizer([d.text for d in _take_mb(train, cfg.tokenizer_train_mb)], cfg.vocab_size)
    hf_tokenizer(tok, cfg.max_position_embeddings).save_pretrained(str(prep_dir / "tokenizer"))
    t_tok = time.time() - t0 - t_collect
    log(f"prep: tokenizer with {tok.get_vocab_size()} tokens trained in {t_tok:.1f}s")

    held_code = _take_mb(held_code, cfg.heldout_eval_mb)
    docstring_texts = [s for d in held_code for s in corpus.docstrings(d.text)]
    streams = {
        "train": [d.text for d in train],
        "heldout_code": [d.text for d in held_code],
        "heldout_prose": [d.text for d in _take_mb(held_prose, cfg.heldout_eval_mb)],
        "heldout_docstring": docstring_texts,
    }
    stats = {}
    for name, texts in streams.items():
        ids = encode_docs(tok, texts)
        np.save(prep_dir / f"{name}.npy", ids)
        stats[name] = {"docs": len(texts), "bytes": sum(len(t.encode()) for t in texts), "tokens": int(len(ids))}
    t_encode = time.time() - t0 - t_collect - t_tok
    log(f"prep: encoded {stats['train']['tokens'] / 1e6:.1f}M training tokens in {t_encode:.1f}s")

    def tally(split, kind):
        sel = [d for d in docs if d.split == split and d.kind == kind]
        return {"files": len(sel), "bytes": sum(d.bytes for d in sel),
                "packages": len({d.package for d in sel})}

    info = {
        "command": command, "roots": [str(r) for r in roots], "dropped": dropped,
        "corpus": {f"{split}_{kind}": tally(split, kind) for split in ("train", "heldout") for kind in ("code", "prose")},
        "heldout_packages": sorted({d.package for d in docs if d.split == "heldout"}),
        "streams": stats, "vocab_size": tok.get_vocab_size(),
        "time_s": {"collect": t_collect, "tokenizer": t_tok, "encode": t_encode, "total": time.time() - t0},
    }
    _atomic_write_text(done, json.dumps(info, indent=1))
    return info


# --------------------------------------------------------------------------------------------- model

def build_model(cfg: Config, shape: Shape, vocab: int, special: dict, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=1e-5,
        tie_word_embeddings=True,  # the embedding is a third of the parameters at this size
        bos_token_id=special["bos"], eos_token_id=special["eos"], pad_token_id=special["pad"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


class Batches:
    """Training windows of seq_len + 1 tokens at stride seq_len, visited in a seeded order per epoch."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        self.windows = tokens.unfold(0, seq_len + 1, seq_len)  # [n, seq_len + 1], a view
        self.n, self.batch_size, self.seed = self.windows.shape[0], batch_size, seed
        self._perm = (None, None)

    def perm(self, epoch: int) -> torch.Tensor:
        if self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.n, generator=g).to(self.windows.device))
        return self._perm[1]

    def get(self, step: int) -> torch.Tensor:  # [batch_size, seq_len + 1] int64; depends only on step
        idx, pos = [], step * self.batch_size
        while pos < (step + 1) * self.batch_size:
            epoch, off = divmod(pos, self.n)
            take = min((step + 1) * self.batch_size - pos, self.n - off)
            idx.append(self.perm(epoch)[off:off + take])
            pos += take
        return self.windows[torch.cat(idx)].long()


def lr_at(step: int, progress: float, peak: float, cfg: Config) -> float:
    """Linear warm-up over steps times a cosine over the stage's progress (steps or seconds, in [0, 1])."""
    cosine = cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return peak * min(1.0, (step + 1) / cfg.warmup_steps) * cosine


@torch.no_grad()
def heldout_loss(model, tokens: torch.Tensor, seq_len: int, batch: int, max_tokens: int, bos: int,
                 autocast: bool) -> float | None:
    """Mean next-token loss (nats) over windows of the stream; predicting a bos after an eos is free, so skipped."""
    if len(tokens) < seq_len + 1:
        return None
    windows = tokens.unfold(0, seq_len + 1, seq_len)[: max(1, max_tokens // seq_len)]
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].long()
        x, y = w[:, :-1], w[:, 1:].masked_fill(w[:, 1:] == bos, -100)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x, use_cache=False).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum").item()
        count += int((y != -100).sum())
    model.train(was_training)
    return total / max(1, count)


# ------------------------------------------------------------------------------------------ training

@dataclass
class Run:
    """How this invocation runs: none of it changes the result, so it may differ between resumes."""
    device: torch.device
    deadline: float
    command: str = ""
    step_limit: int = 0        # stop after this many optimizer steps in this invocation (tests)
    checkpoint_every_s: float = 60.0
    compile: bool = False
    steps_done: int = field(default=0)


def _save(path: Path, state: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train_stage(name: str, model, cfg: Config, run: Run, batches: Batches, heldout: dict, bos: int,
                ckpt_path: Path, budget_s: float, stage_deadline: float, log: Log, teacher=None) -> dict:
    """Train `model` (LM loss, or distillation from `teacher`) for its fixed number of steps, or else for
    `budget_s` seconds of training: then the cosine runs over time, so the stage ends on schedule however
    fast the machine is, and the report gives the step count to pin for an exact rerun.

    Returns the stage state; state["done"] is False when stage_deadline or the step limit came first.
    """
    device = run.device
    peak = cfg.target_lr if teacher is None else cfg.draft_lr
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    state = {"step": 0, "total_steps": (cfg.target_steps if teacher is None else cfg.draft_steps) or None,
             "budget_s": budget_s, "train_time_s": 0.0, "rows": [], "done": False}
    if ckpt_path.is_file():
        saved = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(saved.pop("model"))
        opt.load_state_dict(saved.pop("opt"))
        state.update(saved)  # keeps the stage's own step count or time budget
        if not state["done"]:
            log(f"{name}: resuming at step {state['step']}, {state['train_time_s']:.0f}s trained")
    if state["done"]:
        return state
    tokens_per_step = cfg.batch_size * cfg.seq_len
    fwd = torch.compile(model) if run.compile else model
    first_step_of_run = True
    t_stage_start, train_time_at_start, step_at_start = time.time(), state["train_time_s"], state["step"]
    last_ckpt = time.time()
    model.train()

    def train_time() -> float:
        return train_time_at_start + time.time() - t_stage_start

    def progress() -> float:
        if state["total_steps"]:
            return state["step"] / state["total_steps"]
        return train_time() / max(1e-9, state["budget_s"])

    def save(done: bool):
        state["done"] = done
        state["train_time_s"] = train_time()
        _save(ckpt_path, {**state, "model": model.state_dict(), "opt": opt.state_dict()})

    def record(metric: str, value: float):
        state["rows"].append({"stage": name, "step": state["step"], "tokens": state["step"] * tokens_per_step,
                              "time_s": train_time(), "metric": metric, "value": float(value)})

    def evaluate() -> str:
        msg = []
        for kind, toks in heldout.items():
            loss = heldout_loss(model, toks, cfg.seq_len, cfg.batch_size, cfg.eval_tokens_during, bos, True)
            if loss is not None:
                record(f"heldout_{kind}", loss)
                msg.append(f"held-out {kind} {loss:.3f}")
        return ", ".join(msg)

    def train_step(step_fn):
        batch = batches.get(state["step"])
        x, y = batch[:, :-1], batch[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = step_fn(input_ids=x, use_cache=False).logits.float()  # [B, T, V]
            if teacher is None:
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                parts = {}
            else:
                with torch.no_grad():
                    t_logp = F.log_softmax(teacher(input_ids=x, use_cache=False).logits.float(), -1)
                logp = F.log_softmax(logits, -1)
                kl = F.kl_div(logp.flatten(0, 1), t_logp.flatten(0, 1), log_target=True, reduction="batchmean")
                ce = F.nll_loss(logp.flatten(0, 1), y.flatten())
                loss = cfg.distill_alpha * kl + (1 - cfg.distill_alpha) * ce
                parts = {"kl": kl, "ce": ce}
        loss.backward()
        return loss, parts

    if state["step"] == 0:
        evaluate()
    next_eval = (math.floor(progress() * cfg.evals_per_stage) + 1) / cfg.evals_per_stage
    state["commands"] = state.get("commands", []) + [run.command]
    while progress() < 1.0:
        if run.step_limit and run.steps_done >= run.step_limit or time.time() > stage_deadline:
            if progress() >= 0.98 and not (run.step_limit and run.steps_done >= run.step_limit):
                break  # the cosine is at its floor: finished, give the time to what follows
            save(done=False)
            log(f"{name}: stopped at step {state['step']} ({progress():.0%} of the stage) by the time budget or "
                f"step limit; checkpoint {ckpt_path}")
            return state
        lr = lr_at(state["step"], progress(), peak, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        if first_step_of_run and fwd is not model:
            try:
                loss, parts = train_step(fwd)
            except Exception as e:  # compile trouble must not cost the run: fall back to eager
                log(f"{name}: torch.compile failed ({type(e).__name__}: {e}); training eagerly")
                fwd = model
                opt.zero_grad(set_to_none=True)
                loss, parts = train_step(fwd)
        else:
            loss, parts = train_step(fwd)
        first_step_of_run = False
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        run.steps_done += 1
        step = state["step"]

        if step % cfg.log_every == 0:
            record("train_loss", loss.item())
            for k, v in parts.items():
                record(f"train_{k}", v.item())
            record("lr", lr)
        if progress() >= next_eval or progress() >= 1.0:
            next_eval += 1 / cfg.evals_per_stage
            rate = (step - step_at_start) * tokens_per_step / max(1e-9, time.time() - t_stage_start)
            log(f"{name}: step {step} ({min(1.0, progress()):.0%}), {rate / 1e6:.2f}M tokens/s, "
                f"train loss {loss.item():.3f}, lr {lr:.2e}, {evaluate()}")
        if time.time() - last_ckpt > run.checkpoint_every_s:
            save(done=False)
            last_ckpt = time.time()
    save(done=True)
    mem = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""
    log(f"{name}: done, {state['step']} steps, {state['step'] * tokens_per_step / 1e6:.0f}M tokens "
        f"in {state['train_time_s']:.0f}s{mem}")
    return state


# ---------------------------------------------------------------------------------------- evaluation

@torch.no_grad()
def greedy_generate(model, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """[N, P] -> [N, P + n_new]: the model's greedy continuation. A full forward per token: these models
    are tiny, and it needs no KV-cache API (which transformers keeps renaming)."""
    seq = prompts
    for _ in range(n_new):
        nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)  # [N, 1]
        seq = torch.cat([seq, nxt], 1)
    return seq


def simulate_greedy_sd(match: np.ndarray, k: int) -> dict:
    """Greedy speculative decoding over match[n, j] = "the draft's greedy token equals the target's at
    generated position j, given the target's sequence before it".

    In greedy SD the accepted prefix is always the target's greedy sequence, so the draft's j-th proposal
    in a round equals its greedy token at that position with the true prefix: one teacher-forced draft
    pass gives every round. A verify step drafts k, accepts the matching run a <= k, and emits a + 1
    tokens (the target's own token after the run). Only rounds whose k drafts all fit are counted.
    """
    accepted = steps = 0
    for row in match:
        p = 0
        while p + k <= len(row):
            a = 0
            while a < k and row[p + a]:
                a += 1
            accepted, steps, p = accepted + a, steps + 1, p + a + 1
    return {"k": k, "verify_steps": steps, "drafted": steps * k, "accepted": accepted,
            "acceptance_rate": accepted / max(1, steps * k), "acceptance_length": 1 + accepted / max(1, steps)}


@torch.no_grad()
def acceptance(target, draft, prompts: torch.Tensor, gen_len: int, ks) -> list[dict]:
    seq = greedy_generate(target, prompts, gen_len)  # [N, P + G]
    p = prompts.shape[1]
    draft_next = draft(input_ids=seq[:, :-1], use_cache=False).logits.argmax(-1)  # [N, P + G - 1]
    match = (draft_next[:, p - 1:] == seq[:, p:]).cpu().numpy()  # [N, G]
    return [simulate_greedy_sd(match, k) for k in ks]


def prompts_from(stream: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """n windows of `length` tokens spread evenly over a held-out stream."""
    if len(stream) < length + 1:
        return stream.new_zeros(0, length).long()
    starts = np.linspace(0, len(stream) - length - 1, n).astype(np.int64)
    return torch.stack([stream[s:s + length] for s in starts]).long()


# -------------------------------------------------------------------------------------- export/report

def export(model, tok_dir: Path, out_dir: Path, special: dict) -> None:
    from transformers import GenerationConfig

    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.to(torch.bfloat16).save_pretrained(str(out_dir))
    GenerationConfig(bos_token_id=special["bos"], eos_token_id=special["eos"],
                     pad_token_id=special["pad"]).save_pretrained(str(out_dir))
    for f in sorted(tok_dir.iterdir()):
        shutil.copy(f, out_dir / f.name)


def shipped_sizes(out: Path) -> dict:
    files = {str(f.relative_to(out)): f.stat().st_size
             for sub in ("target", "draft") for f in sorted((out / sub).rglob("*")) if f.is_file()}
    return {"files": files, "total": sum(files.values()), "largest": max(files.values()),
            "ok": sum(files.values()) <= SIZE_LIMIT and max(files.values()) <= FILE_LIMIT}


def plot_loss(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, stage in zip(axes, ("target", "draft")):
        metrics = sorted({r["metric"] for r in rows if r["stage"] == stage and r["metric"] != "lr"})
        for m in metrics:
            pts = [(r["tokens"] / 1e6, r["value"]) for r in rows if r["stage"] == stage and r["metric"] == m]
            ax.plot(*zip(*pts), label=m, marker="o" if m.startswith("heldout") else None, markersize=3,
                    linewidth=1.5 if m.startswith("heldout") else 0.8)
        ax.set(title=f"{stage}", xlabel="training tokens (M)", ylabel="nats / token")
        ax.grid(alpha=0.3)
        if metrics:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_loss_table(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5, cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def write_report(path: Path, m: dict) -> None:
    cfg, prep = m["config"], m["prep"]
    lines = [
        "# Default draft/target pair: training report", "",
        f"Commit {m['commit']}, {m['env']}, device {m['device']}.", "",
        "| stage | run by |", "|---|---|",
        f"| prep | `{prep.get('command') or 'unknown'}` |",
        *(f"| {n} | {', '.join(f'`{c}`' for c in m['stages'][n]['commands']) or 'unknown'} |" for n in ("target", "draft")),
        f"| export, evaluation, this report | `{m['command']}` (wall {m['wall_s']:.0f}s of a {m['time_budget_s']:.0f}s budget) |",
        "", *m.get("notes", []),
        "## Corpus", "",
        f"Python sources (`.py`) and prose docs (`.md`, `.rst`, `.txt`, package descriptions from `METADATA`) "
        f"of the site-packages of the interpreter that ran this ({', '.join(prep['roots'])}), deduplicated by "
        f"sha256 of the content; whole top-level packages held out by a seeded hash "
        f"(seed {cfg['seed']}, fraction {cfg['heldout_frac']}). Manifest: `manifest.jsonl.gz`. "
        f"Dropped: {prep['dropped']}.", "",
        "| split | kind | files | MB | packages |", "|---|---|---:|---:|---:|",
    ]
    for key, t in prep["corpus"].items():
        split, kind = key.split("_")
        lines.append(f"| {split} | {kind} | {t['files']} | {t['bytes'] / 1e6:.1f} | {t['packages']} |")
    lines += ["", f"Held-out packages: {', '.join(prep['heldout_packages'])}.", "",
              "| token stream | docs | MB | tokens | bytes/token |", "|---|---:|---:|---:|---:|"]
    for name, s in prep["streams"].items():
        lines.append(f"| {name} | {s['docs']} | {s['bytes'] / 1e6:.1f} | {s['tokens']:,} | "
                     f"{s['bytes'] / max(1, s['tokens']):.2f} |")
    lines += ["", f"Tokenizer: byte-level BPE, {prep['vocab_size']} tokens, trained on "
              f"{cfg['tokenizer_train_mb']} MB of training files; specials {', '.join(SPECIAL_TOKENS)}. "
              f"Prep took {prep['time_s']['total']:.0f}s (collect {prep['time_s']['collect']:.0f}s, tokenizer "
              f"{prep['time_s']['tokenizer']:.0f}s, encode {prep['time_s']['encode']:.0f}s).", "",
              "## Models and training", "",
              "| model | shape | parameters | steps | tokens | train time | final train LM loss |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for name in ("target", "draft"):
        s, st = cfg[name], m["stages"][name]
        lines.append(f"| {name} | {s['layers']} layers, hidden {s['hidden']}, heads {s['heads']}/{s['kv_heads']} kv, "
                     f"head_dim {s['head_dim']}, mlp {s['intermediate']} | {m['params'][name]:,} | {st['steps']} | "
                     f"{st['tokens'] / 1e6:.0f}M | {st['train_time_s']:.0f}s | {_fmt(st['final_train_loss'])} |")
    lines += ["", f"Llama (`LlamaForCausalLM`), tied embeddings, seq len {cfg['seq_len']} "
              f"(max_position_embeddings {cfg['max_position_embeddings']}), batch {cfg['batch_size']} sequences, "
              f"AdamW (0.9, 0.95), weight decay {cfg['weight_decay']}, warmup {cfg['warmup_steps']} steps, cosine to "
              f"{cfg['min_lr_frac']}× of peak LR (target {cfg['target_lr']}, draft {cfg['draft_lr']}), bf16 autocast. "
              f"The draft minimises {cfg['distill_alpha']}·KL(target‖draft) + {1 - cfg['distill_alpha']:.2f}·LM loss "
              f"against the bf16 target. To reproduce these exact step counts pass "
              f"`--target-steps {m['stages']['target']['steps']} --draft-steps {m['stages']['draft']['steps']}`.", "",
              "![loss curves](loss.png)", "",
              "## Held-out loss (shipped bf16 weights, fp32 compute)", "",
              "| model | stream | nats/token | perplexity | bits/byte |", "|---|---|---:|---:|---:|"]
    for name in ("target", "draft"):
        for stream, r in m["heldout"][name].items():
            lines.append(f"| {name} | {stream} | {_fmt(r['loss'])} | {_fmt(r['ppl'], '.2f')} | {_fmt(r['bpb'])} |")
    goal_k, goal = ACCEPT_GOAL
    at_goal = next(a for a in m["acceptance"] if a["k"] == goal_k) if any(a["k"] == goal_k for a in m["acceptance"]) else None
    lines += ["", "## Greedy speculative decoding on held-out code", "",
              f"{m['accept_setup']}. acceptance_rate = accepted / drafted, "
              f"acceptance_length = 1 + accepted / verify_steps.", "",
              "| k | verify steps | acceptance_rate | acceptance_length |", "|---:|---:|---:|---:|"]
    for a in m["acceptance"]:
        lines.append(f"| {a['k']} | {a['verify_steps']} | {a['acceptance_rate']:.3f} | {a['acceptance_length']:.3f} |")
    if at_goal:
        lines += ["", f"Goal acceptance_length ≥ {goal} at k={goal_k}: "
                  f"{'met' if at_goal['acceptance_length'] >= goal else 'NOT met'} ({at_goal['acceptance_length']:.3f})."]
    lines += ["", "## Speed-up of sd and psd over ar", "",
              "Measured through the runtime by `python -m bench.default_pair_speed` (on a GPU machine: "
              "bench/results/default_pair_speed_gpu.md; CPU rows, informational: default_pair_speed_cpu.md)."]
    sz = m["sizes"]
    lines += ["", "## Shipped files", "", "| file | bytes |", "|---|---:|"]
    lines += [f"| {f} | {b:,} |" for f, b in sz["files"].items()]
    lines += [f"| **total** | **{sz['total']:,}** |", "",
              f"Total {sz['total'] / 1e6:.2f} MB (limit {SIZE_LIMIT / 1e6:.0f} MB), largest file {sz['largest'] / 1e6:.2f} MB "
              f"(limit {FILE_LIMIT / 1e6:.0f} MB): {'within limits' if sz['ok'] else 'OVER LIMIT'}.", "",
              f"Time: {', '.join(f'{k} {v:.0f}s' for k, v in m['timing'].items())}.", ""]
    path.write_text("\n".join(lines))


@torch.no_grad()
def finish(cfg: Config, prep: dict, ckpt: Path, out: Path, special: dict, device: torch.device,
           states: dict, meta: dict, log: Log) -> dict:
    from transformers import LlamaForCausalLM

    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = ckpt / "prep" / "tokenizer"
    params = {}
    for name in ("target", "draft"):
        model = build_model(cfg, getattr(cfg, name), prep["vocab_size"], special, cfg.seed)
        model.load_state_dict(states[name]["model"])
        params[name] = param_count(model)
        export(model, tok_dir, out / name, special)
    shutil.copy(ckpt / "prep" / "manifest.jsonl.gz", out / "manifest.jsonl.gz")
    rows = states["target"]["rows"] + states["draft"]["rows"]
    write_loss_table(rows, out / "loss.parquet")
    plot_loss(rows, out / "loss.png")

    # evaluate exactly what ships: bf16 weights, computed in fp32
    models = {name: LlamaForCausalLM.from_pretrained(str(out / name), dtype=torch.float32).to(device).eval()
              for name in ("target", "draft")}
    heldout = {}
    for name, model in models.items():
        heldout[name] = {}
        for kind in ("code", "prose", "docstring"):
            stream = f"heldout_{kind}"
            toks = torch.from_numpy(np.load(ckpt / "prep" / f"{stream}.npy").astype(np.int32)).to(device)
            loss = heldout_loss(model, toks, cfg.seq_len, cfg.batch_size, cfg.eval_tokens,
                                special["bos"], autocast=False)
            s = prep["streams"][stream]
            heldout[name][kind] = {"loss": loss, "ppl": None if loss is None else math.exp(loss),
                                   "bpb": None if loss is None else loss / math.log(2) * s["tokens"] / max(1, s["bytes"])}
    code = torch.from_numpy(np.load(ckpt / "prep" / "heldout_code.npy").astype(np.int32))
    prompts = prompts_from(code, cfg.accept_prompts, cfg.prompt_len).to(device)
    accept = acceptance(models["target"], models["draft"], prompts, cfg.gen_len, range(1, cfg.max_k + 1))
    log("acceptance on held-out code: " + ", ".join(
        f"k={a['k']} len {a['acceptance_length']:.2f} rate {a['acceptance_rate']:.2f}" for a in accept))
    sizes = shipped_sizes(out)
    log(f"shipped pair: {sizes['total'] / 1e6:.2f} MB in {len(sizes['files'])} files"
        + ("" if sizes["ok"] else " -- OVER THE SIZE LIMIT"))

    def stage_summary(st):
        # the LM loss: for the draft the distillation objective is logged as train_loss, the LM part as train_ce
        metric = "train_ce" if any(r["metric"] == "train_ce" for r in st["rows"]) else "train_loss"
        losses = [r["value"] for r in st["rows"] if r["metric"] == metric]
        return {"steps": st["step"], "tokens": st["step"] * cfg.batch_size * cfg.seq_len,
                "train_time_s": st["train_time_s"], "final_train_loss": losses[-1] if losses else None,
                "commands": st.get("commands", [])}

    metrics = {
        **meta, "config": dataclasses.asdict(cfg), "prep": prep, "params": params,
        "stages": {n: stage_summary(states[n]) for n in ("target", "draft")},
        "heldout": heldout, "acceptance": accept, "sizes": sizes,
        "accept_setup": f"{len(prompts)} prompts of {cfg.prompt_len} held-out code tokens, {cfg.gen_len} greedy "
                        f"target tokens each, draft proposals checked against them",
    }
    metrics["timing"] = {"prep": prep["time_s"]["total"], "target": states["target"]["train_time_s"],
                         "draft": states["draft"]["train_time_s"], "export+eval": time.time() - t0}
    metrics["wall_s"] = time.time() - meta["t_start"]
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
    write_report(out / "report.md", metrics)
    log(f"wrote {out}/report.md")
    return metrics


# ----------------------------------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output folder (target/, draft/, report.md, ...)")
    p.add_argument("--ckpt-dir", type=Path, default=None,
                   help="checkpoints and prep cache (default checkpoints/default_pair[_smoke])")
    p.add_argument("--time-budget-s", type=float, default=500.0, help="wall-clock budget of this invocation")
    p.add_argument("--smoke", action="store_true", help="tiny corpus slice, tiny models, a few CPU steps")
    p.add_argument("--stop-after", choices=("prep", "target", "draft"), default="draft",
                   help="stop after this stage (draft: run everything and write the outputs)")
    p.add_argument("--device", default=None, help="default: cuda if available (cpu for --smoke)")
    p.add_argument("--compile", action="store_true", help="torch.compile the trained model (falls back to eager)")
    p.add_argument("--eval-reserve-s", type=float, default=None, help="time kept for export and evaluation")
    p.add_argument("--step-limit", type=int, default=0, help="stop after this many steps in this invocation")
    p.add_argument("--seed", type=int)
    p.add_argument("--target-steps", type=int)
    p.add_argument("--draft-steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--max-corpus-mb", type=float)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log, t_start = Log(), time.time()
    cfg = Config(**SMOKE) if args.smoke else Config()
    for name in ("seed", "target_steps", "draft_steps", "batch_size", "max_corpus_mb"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    ckpt = args.ckpt_dir or Path("checkpoints") / ("default_pair_smoke" if args.smoke else "default_pair")
    ckpt.mkdir(parents=True, exist_ok=True)
    cfg_json = json.dumps(dataclasses.asdict(cfg), indent=1, sort_keys=True)
    if (ckpt / "config.json").is_file() and (ckpt / "config.json").read_text() != cfg_json:
        raise SystemExit(f"{ckpt} holds checkpoints of a different configuration; pass another --ckpt-dir")
    _atomic_write_text(ckpt / "config.json", cfg_json)
    command = "python -m minedraft_ray.training.train_pair " + " ".join(argv if argv is not None else sys.argv[1:])
    run = Run(device=device, deadline=t_start + args.time_budget_s, command=command, step_limit=args.step_limit,
              compile=args.compile)
    reserve = args.eval_reserve_s if args.eval_reserve_s is not None else (0.0 if args.smoke else 30.0)
    log(f"device {device}, budget {args.time_budget_s:.0f}s, checkpoints in {ckpt}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 evaluation stays fp32

    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass

    prep = prepare(cfg, ckpt / "prep", log, command)
    if args.stop_after == "prep":
        return 0
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "prep" / "tokenizer" / "tokenizer.json"))
    special = {"eos": tok.token_to_id(EOS), "bos": tok.token_to_id(BOS), "pad": tok.token_to_id(PAD)}

    def load_tokens(name):
        return torch.from_numpy(np.load(ckpt / "prep" / f"{name}.npy").astype(np.int32)).to(device)

    heldout = {"code": load_tokens("heldout_code"), "prose": load_tokens("heldout_prose")}
    train_tokens = load_tokens("train")
    stages = ["target", "draft"][: 1 if args.stop_after == "target" else 2]
    shares = {"target": cfg.target_share, "draft": 1 - cfg.target_share}
    states = {}
    for i, name in enumerate(stages):
        path = ckpt / f"{name}.pt"
        model = build_model(cfg, getattr(cfg, name), prep["vocab_size"], special,
                            cfg.seed + (0 if name == "target" else 1)).to(device)
        teacher = None
        if name == "draft":
            teacher = build_model(cfg, cfg.target, prep["vocab_size"], special, cfg.seed)
            teacher.load_state_dict(states["target"]["model"])
            teacher = teacher.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)  # what ships
        end = run.deadline - (reserve if args.stop_after == "draft" else 0.0)
        # 0.98: model building and the first evaluation also come out of the stage's time
        stage_budget = 0.98 * max(0.0, end - time.time()) * shares[name] / sum(shares[s] for s in stages[i:])
        # the time-driven schedule ends the stage on its budget; the deadline only stops a resumed stage
        # whose remaining budget no longer fits this invocation
        stage_deadline = end
        batches = Batches(train_tokens, cfg.seq_len, cfg.batch_size, cfg.seed + i)
        if path.is_file():
            log(f"{name}: found checkpoint {path}")
        else:
            log(f"{name}: {param_count(model):,} parameters, budget {stage_budget:.0f}s")
        state = train_stage(name, model, cfg, run, batches, heldout, special["bos"], path, stage_budget,
                            stage_deadline, log, teacher)
        if not state["done"]:
            log("not finished: run the same command again to continue from the checkpoint")
            return 3
        states[name] = {**state, "model": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
        del model, teacher
    if args.stop_after != "draft":
        return 0
    meta = {"command": command,
            "commit": _git_commit(), "t_start": t_start, "time_budget_s": args.time_budget_s,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "env": f"python {platform.python_version()}, torch {torch.__version__}, "
                   f"transformers {__import__('transformers').__version__}, tokenizers {__import__('tokenizers').__version__}"}
    finish(cfg, prep, ckpt, args.out, special, device, states, meta, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
