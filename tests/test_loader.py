"""Checkpoint loading, config parsing, target/draft pairing, and KV rollback."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from minedraft_ray.engine.hf_config import UnsupportedArchitectureError
from minedraft_ray.engine.loader import CheckpointError, load_model
from minedraft_ray.engine.pair import IncompatiblePairError, check_pair
from minedraft_ray.engine.model import ModelConfig
from minedraft_ray.testing.tiny import make_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_like_single_file(tiny_qwen3, tmp_path):
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(tiny_qwen3)).save_pretrained(str(sharded), max_shard_size="40KB")
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_qwen3 / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    single, split = load_model(tiny_qwen3, "cpu"), load_model(sharded, "cpu")
    for (name, a), (_, b) in zip(single.state_dict().items(), split.state_dict().items()):
        assert torch.equal(a, b), name


def test_eos_ids_merge_config_and_generation_config(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama", eos_token_ids=[5, 2, 7])
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.eos_token_ids == (2, 5, 7)  # config.json's 2 first, then generation_config's list, deduplicated
    assert cfg.bos_token_id == 1 and cfg.dtype == torch.float32


def test_llama3_style_config_without_transformers():
    """A transformers-4 era Llama-3.1 config.json: rope_scaling + rope_theta apart, torch_dtype, eos list."""
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
          "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"},
          "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
          "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    cfg = ModelConfig.from_hf_dict(hf, {"eos_token_id": [128001, 128008, 128009]})
    assert cfg.eos_token_ids == (128001, 128008, 128009)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 8 and cfg.dtype == torch.bfloat16


def test_unsupported_architecture_names_supported_ones(tiny_llama, tmp_path):
    path = _copy_checkpoint(tiny_llama, tmp_path / "gpt2")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(path, "cpu")
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert name in str(err.value)


def test_missing_files_are_named(tiny_llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere", "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "empty", "cpu")
    path = _copy_checkpoint(tiny_llama, tmp_path / "no_weights")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(path, "cpu")


def test_missing_tensor_is_named(tiny_llama, tmp_path):
    path = _copy_checkpoint(tiny_llama, tmp_path / "partial")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path, "cpu")


def test_pair_with_different_tokenizer_is_refused(tiny_llama, tmp_path):
    other = make_tiny_model(tmp_path / "other_vocab", "llama", vocab_size=480)
    with pytest.raises(IncompatiblePairError, match="vocabularies differ"):
        check_pair(tiny_llama, other)
    other_eos = make_tiny_model(tmp_path / "other_eos", "llama", eos_token_ids=[2, 9])
    with pytest.raises(IncompatiblePairError, match="EOS ids differ"):
        check_pair(tiny_llama, other_eos)


def test_padded_vocab_pair_is_compatible(tiny_llama, tiny_llama_draft, tmp_path):
    padded = make_tiny_model(tmp_path / "padded", "qwen2", vocab_pad=16)  # embedding 528 rows, tokenizer 512
    assert ModelConfig.from_pretrained(padded).vocab_size == 528
    assert check_pair(padded, tiny_llama).shared_vocab == 512
    assert check_pair(tiny_llama, padded).shared_vocab == 512
    assert check_pair(tiny_llama, tiny_llama_draft).shared_vocab == 512


@pytest.mark.parametrize("kept", [0, 2])
@torch.no_grad()
def test_rollback_then_reappend_matches_fresh_run(tiny_llama, kept):
    """A verify step writes 4 tokens; all but `kept` are rolled back by lowering the length, then 3 more append."""
    model = load_model(tiny_llama, "cpu")
    gen = torch.Generator().manual_seed(0)
    prompt, verified, appended = (torch.randint(4, 512, (1, n), generator=gen) for n in (6, 4, 3))
    slot = torch.tensor([1])
    cache = model.make_cache(num_slots=2, max_len=32)
    model(prompt, cache, slot)
    cache.lengths[slot] += 6
    model(verified, cache, slot)
    cache.lengths[slot] += 4
    cache.lengths[slot] -= 4 - kept  # rollback: stale K/V rows stay and must be overwritten, never read
    got = model.compute_logits(model(appended, cache, slot))

    fresh = model.make_cache(num_slots=1, max_len=32)
    seq = torch.cat([prompt, verified[:, :kept], appended], 1)
    want = model.compute_logits(model(seq, fresh, torch.tensor([0])))[:, 6 + kept:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
