"""Whether a draft model may draft for a target: the draft's token ids must mean the target's text. Read from the
two folders' config.json and tokenizer files, never their weights; this module imports no torch (the Serve app
builder checks the pair, and runs no model)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import EngineConfig
from .hf_config import ModelSpec
from .hub import model_dirs
from .tokenizer import load_tokenizer


class IncompatiblePairError(ValueError):
    pass


@dataclass
class PairInfo:
    shared_vocab: int  # ids both models may emit; logits at ids >= shared_vocab must be masked


def _merges(path: Path) -> list[tuple[str, ...]] | None:
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    merges = json.loads(file.read_text()).get("model", {}).get("merges")
    if merges is None:
        return None
    # tokenizers < 0.20 writes "a b", newer versions ["a", "b"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


def _special_tokens(tok) -> dict[str, int]:
    specials = {t.content: i for i, t in tok.added_tokens_decoder.items() if t.special}
    for t in tok.all_special_tokens:
        specials[t] = tok.convert_tokens_to_ids(t)
    return specials


def _describe_dict_diff(name: str, a: dict, b: dict) -> str:
    only_a, only_b = a.keys() - b.keys(), b.keys() - a.keys()
    moved = [k for k in a.keys() & b.keys() if a[k] != b[k]]
    parts = []
    if only_a:
        parts.append(f"{len(only_a)} only in target (e.g. {sorted(only_a)[0]!r})")
    if only_b:
        parts.append(f"{len(only_b)} only in draft (e.g. {sorted(only_b)[0]!r})")
    if moved:
        k = sorted(moved)[0]
        parts.append(f"{len(moved)} with different ids (e.g. {k!r}: {a[k]} vs {b[k]})")
    return f"{name} differ: " + "; ".join(parts)


def check_pair(target_path, draft_path, target_tok=None) -> PairInfo:
    """Raise IncompatiblePairError unless the draft's token ids mean the same text as the target's. target_tok:
    the target's tokenizer where the caller has loaded it already (a large vocabulary takes a while to load)."""
    target_path, draft_path = Path(target_path), Path(draft_path)
    target_cfg, draft_cfg = ModelSpec.from_pretrained(target_path), ModelSpec.from_pretrained(draft_path)
    target_tok = load_tokenizer(target_path) if target_tok is None else target_tok
    draft_tok = load_tokenizer(draft_path)
    problems = []
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        problems.append(_describe_dict_diff("vocabularies", target_vocab, draft_vocab))
    target_merges, draft_merges = _merges(target_path), _merges(draft_path)
    if target_merges is not None and draft_merges is not None and target_merges != draft_merges:
        first = next((i for i, (a, b) in enumerate(zip(target_merges, draft_merges)) if a != b),
                     min(len(target_merges), len(draft_merges)))
        problems.append(f"BPE merges differ ({len(target_merges)} vs {len(draft_merges)} merges, "
                        f"first difference at merge {first})")
    target_special, draft_special = _special_tokens(target_tok), _special_tokens(draft_tok)
    if target_special != draft_special:
        problems.append(_describe_dict_diff("special tokens", target_special, draft_special))
    if set(target_cfg.eos_token_ids) != set(draft_cfg.eos_token_ids):
        problems.append(f"EOS ids differ: target {list(target_cfg.eos_token_ids)}, "
                        f"draft {list(draft_cfg.eos_token_ids)}")
    if problems:
        raise IncompatiblePairError(f"draft {draft_path} cannot draft for target {target_path}: "
                                    + "; ".join(problems))
    # embeddings may be padded past the tokenizer (e.g. 151,936 vs 152,064): only real tokens are shared
    return PairInfo(shared_vocab=min(len(target_tok), target_cfg.vocab_size, draft_cfg.vocab_size))


def shared_vocab(config: EngineConfig, target_tok=None) -> int | None:
    """The ids both the target and the draft may emit (None without a drafter); IncompatiblePairError unless the
    draft's ids mean the target's text. Checked once, by whoever starts the engine (LLM, the Serve app builder),
    where the tokenizer is loaded anyway: the manager and the worker actors start without transformers, whose
    import and tokenizer loads took a few CPU-s in each of them (and again at every drafter restart). target_tok:
    the target's tokenizer, which the caller has loaded anyway."""
    if not config.uses_drafter:
        return None
    return check_pair(*model_dirs(config), target_tok=target_tok).shared_vocab
