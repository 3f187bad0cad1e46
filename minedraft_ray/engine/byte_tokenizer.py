"""A small byte-level BPE tokenizer trained offline on an embedded text: the tokenizer of `random:<preset>`
models (engine/presets.py) and of the tests' tiny checkpoints (testing/tiny.py). No hub is needed to build it.
"""
from __future__ import annotations

_CORPUS = '''
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Speculative decoding lets a small draft model propose several tokens that a large target model then
verifies in one forward pass. When the draft agrees with the target, many tokens are accepted at once;
when it disagrees, the first rejected token is replaced by a sample from the corrected distribution.
The output distribution is exactly the one of the target model, so the method is lossless.
Batch parallel speculative decoding runs the drafter and the verifier on different devices. While the
verifier checks one batch, the drafter prepares the next batch, and the two batches swap every step.
In the morning the sun rises over the hills, and the birds begin to sing in the old oak trees.
She opened the window, looked at the garden, and wrote a long letter to her brother in the city.
Reading a good book on a rainy afternoon is one of the simple pleasures of life.
Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.
The history of computing is full of small ideas that changed everything: the stored program, the
compiler, the transistor, the integrated circuit, the personal computer and the network.
Please answer the question briefly. What is the capital of France? The capital of France is Paris.
What is two plus two? Two plus two is four. Name three colors: red, green and blue.
Once upon a time there was a little robot who wanted to learn how to paint pictures of the sea.
Every day the robot walked to the beach, watched the waves, and tried again with a new brush.

def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value


def read_lines(path):
    with open(path, "r", encoding="utf-8") as f:
        return [line.rstrip("\\n") for line in f if line.strip()]


import torch
import numpy as np

x = torch.randn(4, 8)
y = torch.softmax(x, dim=-1)
print(y.sum(dim=-1))
values = np.arange(10) * 2
result = {"mean": float(values.mean()), "max": int(values.max())}
for key, value in sorted(result.items()):
    print(f"{key}: {value}")

if __name__ == "__main__":
    numbers = [fibonacci(i) for i in range(10)]
    print("numbers:", numbers)
    counter = Counter()
    while counter.value < 5:
        counter.increment()
    assert counter.value == 5, "counter should reach five"
'''

# <|endoftext|> as in Qwen vocabularies: transformers loads any qwen2 checkpoint with Qwen2Tokenizer, which adds it
# (as unk) when the vocabulary lacks it, so without it a tiny qwen2 tokenizer would be one token longer
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|endoftext|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(out_dir, vocab_size: int = 512):
    """Train a byte-level BPE on the embedded corpus and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"corpus too small for a {vocab_size}-token vocabulary ({tok.get_vocab_size()} learned)")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast
