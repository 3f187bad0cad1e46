"""The training corpus: Python sources and prose docs from the running interpreter's site-packages.

Files are deduplicated by content hash (site-packages carry vendored copies of each other), and whole
top-level packages are held out, chosen by a seeded hash of the package name, so held-out loss measures
packages the model has never seen rather than copies of ones it has. Every choice here depends only on
paths, contents and the seed, never on hash() or directory order, so two machines with the same
packages get the same corpus.
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import json
import os
import re
import site
import sysconfig
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

CODE_EXTS = (".py",)
PROSE_EXTS = (".md", ".rst", ".txt")
# prose-looking files that are licences or packaging metadata, not documentation
_SKIP_NAME = re.compile(r"^(licen[cs]e|copying|notice|authors|contributors|requirements|entry_points|top_level|"
                        r"dependency_links|namespace_packages|not-zip-safe|sources|installer|record)", re.IGNORECASE)
MANIFEST_FIELDS = ("package", "path", "sha256", "bytes", "kind", "split")


@dataclass
class Doc:
    package: str  # top-level import package; the unit of the held-out split
    path: str     # relative to its site-packages folder, "/"-separated
    sha256: str
    bytes: int
    kind: str     # "code" | "prose"
    split: str    # "train" | "heldout"
    text: str = field(default="", repr=False)


def site_packages_roots() -> list[Path]:
    """The running interpreter's site-packages folders (a venv's lib64 is often a link to lib)."""
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    roots, seen = [], set()
    for p in paths:
        real = os.path.realpath(p)
        if os.path.isdir(real) and real not in seen:
            seen.add(real)
            roots.append(Path(real))
    return roots


def unit_hash(seed: int, key: str) -> float:
    """Uniform in [0, 1), stable across processes and machines (hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big") / 2**64


def is_heldout(package: str, seed: int, frac: float) -> bool:
    return unit_hash(seed, "heldout/" + package) < frac


def _dist_package(dist_info: Path) -> str:
    """The import package a distribution installs most files into; its METADATA goes with that package."""
    counts = Counter()
    record = dist_info / "RECORD"
    if record.is_file():
        for line in record.read_text(errors="replace").splitlines():
            path = line.split(",", 1)[0]
            top = path.split("/", 1)[0]
            if not top or top.startswith("..") or top == "__pycache__" or top.endswith((".dist-info", ".data", ".pth")):
                continue
            counts[top if "/" in path else top.split(".", 1)[0]] += 1  # six.py, _foo.cpython-312-x86_64.so
    if counts:
        return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
    return dist_info.name.split("-", 1)[0].lower()


def _candidates(root: Path) -> list[tuple[str, str, str]]:
    """(relative path, kind, package) of every file that may enter the corpus, in a fixed order."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            for d in sorted(dirnames):
                if d.endswith(".dist-info") and (root / d / "METADATA").is_file():
                    out.append((f"{d}/METADATA", "prose", _dist_package(root / d)))
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.endswith((".dist-info", ".egg-info")))
        for name in sorted(filenames):
            ext = os.path.splitext(name)[1]
            if ext in CODE_EXTS:
                kind = "code"
            elif ext in PROSE_EXTS and not _SKIP_NAME.match(name):
                kind = "prose"
            else:
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
            package = rel.split("/", 1)[0] if "/" in rel else os.path.splitext(name)[0]
            out.append((rel, kind, package))
    return out


def _metadata_body(text: str) -> str:
    """The long description of a METADATA file: what follows the RFC 822 headers."""
    head, sep, body = text.partition("\n\n")
    return body if sep else ""


def _usable(text: str, kind: str) -> bool:
    """Reject generated tables, minified files and numeric test data that happen to carry .py/.txt names."""
    if not text.strip():
        return False
    long_line = 300 if kind == "code" else 2000  # markdown paragraphs are often one line
    if sum(len(line) for line in text.splitlines() if len(line) > long_line) > 0.1 * len(text):
        return False
    if kind == "prose":
        visible = sum(not c.isspace() for c in text)
        letters = sum(c.isalpha() for c in text)
        return letters >= 0.55 * visible
    return True


def collect(roots: list[Path], *, seed: int = 0, heldout_frac: float = 0.05, max_bytes: float | None = None,
            min_file_bytes: int = 64, max_file_bytes: int = 1 << 20, threads: int = 16) -> tuple[list[Doc], dict]:
    """Read, filter and deduplicate the corpus; return (docs in a fixed order, counts of what was dropped).

    max_bytes keeps a seeded uniform sample of the files (by path) so the expected total is about that.
    The first copy of each content in (root, path) order wins; since a held-out package and a training
    package never keep the same content, no held-out file is also trained on.
    """
    cands = []  # (root, rel, kind, package, size)
    for root in roots:
        for rel, kind, package in _candidates(root):
            try:
                size = (root / rel).stat().st_size
            except OSError:
                continue
            if min_file_bytes <= size <= max_file_bytes:
                cands.append((root, rel, kind, package, size))
    total = sum(c[4] for c in cands)
    keep = 1.0 if not max_bytes or total <= max_bytes else max_bytes / total
    if keep < 1.0:
        cands = [c for c in cands if unit_hash(seed, "sample/" + c[1]) < keep]

    def read(c):
        try:
            data = (c[0] / c[1]).read_bytes()
        except OSError:
            return None, ""
        return data, hashlib.sha256(data).hexdigest()

    docs, seen, dropped = [], set(), Counter()
    with ThreadPoolExecutor(threads) as pool:  # file reads and sha256 release the GIL
        for (root, rel, kind, package, _), (data, digest) in zip(cands, pool.map(read, cands, chunksize=64)):
            if data is None:
                dropped["unreadable"] += 1
                continue
            if digest in seen:
                dropped["duplicate"] += 1
                continue
            seen.add(digest)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                dropped["not_utf8"] += 1
                continue
            if rel.endswith(".dist-info/METADATA"):
                text = _metadata_body(text)
            if len(text) < min_file_bytes or not _usable(text, kind):
                dropped["filtered"] += 1
                continue
            split = "heldout" if is_heldout(package, seed, heldout_frac) else "train"
            docs.append(Doc(package, rel, digest, len(data), kind, split, text))
    dropped["sampled_out_fraction"] = round(1.0 - keep, 4)
    return docs, dict(dropped)


def docstrings(source: str, min_chars: int = 100) -> list[str]:
    """Docstrings of a module, its classes and functions: held-out prose that lives inside code."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences etc. in old sources
            tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= min_chars:
                out.append(doc)
    return out


def write_manifest(docs: list[Doc], path) -> None:
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:  # mtime=0: same bytes every run
        for d in docs:
            f.write((json.dumps({k: getattr(d, k) for k in MANIFEST_FIELDS}, separators=(",", ":")) + "\n").encode())


def read_manifest(path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]
