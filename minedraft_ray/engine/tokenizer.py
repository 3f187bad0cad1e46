"""A model folder's tokenizer and chat template, without torch where the tokenizer's class is known.

transformers' AutoTokenizer imports torch (its module reaches the model configs, which import it), which costs a
process that only tokenizes (the Serve ingress) a second at every start. AutoTokenizer only picks a class and calls
its `from_pretrained`; a process that was told the class it picks (`tokenizer_class_path`, found where torch is
loaded anyway) builds the same tokenizer from that class, whose own module does not import torch.
"""
from __future__ import annotations

import importlib
import threading
from pathlib import Path

# transformers' lazy module is not thread-safe on first use: two engines built in threads at once (data-parallel
# replicas in one process) can fail with "cannot import name 'AutoTokenizer'"
_TRANSFORMERS_IMPORT = threading.Lock()


def load_tokenizer(path, class_path: str | None = None):
    """The tokenizer AutoTokenizer loads from folder `path`; built from `class_path` (`tokenizer_class_path` of
    that tokenizer) when given, without AutoTokenizer."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer folder {path} does not exist")
    with _TRANSFORMERS_IMPORT:
        if class_path is None:
            from transformers import AutoTokenizer as cls
        else:
            module, _, name = class_path.partition(":")
            if module != "transformers" and not module.startswith("transformers."):
                raise ValueError(f"tokenizer class {class_path!r} is not one of transformers'")
            cls = getattr(importlib.import_module(module), name)
    return cls.from_pretrained(str(path), local_files_only=True)


def tokenizer_class_path(tokenizer) -> str:
    """"module:name" of a tokenizer's class, for `load_tokenizer` in another process."""
    cls = type(tokenizer)
    return f"{cls.__module__}:{cls.__qualname__}"


def load_chat_template(value: str) -> str:
    """A chat template given as a file path or as the Jinja text itself (vLLM's --chat-template)."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:   # a long inline template is no valid path
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise FileNotFoundError(f"chat template {value!r}: no such file, and it is no Jinja template either")
