"""Small helpers shared by the bench scripts: provenance, progress bars, timing, result files."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm


def git_sha() -> str:
    """GIT_SHA from the environment (the GPU machine gets the tree without .git), else `git rev-parse`."""
    if os.environ.get("GIT_SHA"):
        return os.environ["GIT_SHA"]
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command that reproduces this run, as typed in the repository root (argv: its arguments, default
    this process's)."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def run_context(shape: str, dtype: torch.dtype, device: torch.device, module: str, argv: list[str] | None) -> dict:
    """The columns every row of a kernel/step benchmark carries: the shape, dtype, git sha, command and device."""
    return {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "git_sha": git_sha(),
            "command": command_line(module, argv), "device": device_name(device)}


def triton_device(parser, smoke: bool) -> torch.device:
    """A Triton kernel's bench: the GPU, or with --smoke Triton's interpreter on the CPU (chosen before Triton is
    first imported); without either, the parser's error."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not smoke:
        parser.error("needs a CUDA device (or --smoke)")
    os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cpu")


def versions() -> str:
    import transformers
    import triton

    return f"torch {torch.__version__}, transformers {transformers.__version__}, triton {triton.__version__}"


def progress(iterable, desc: str | None, total: int | None = None):
    # stderr, throttled: the GPU machine returns only the tail of the output. desc None: no bar at all
    return tqdm(iterable, desc=desc, total=total, mininterval=2.0, leave=False, file=sys.stderr,
                disable=desc is None)


def say(text: str) -> None:
    """print that keeps the progress bars intact."""
    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], object], device: torch.device, warmup: int, reps: int, desc: str | None,
               before: Callable[[], object] | None = None) -> list[float]:
    """Milliseconds of each of `reps` calls of `step` after `warmup` untimed ones.

    `before` runs ahead of every call, outside the timed span. On CUDA each call is bracketed by
    events (no sync between calls, one at each end); on CPU by the wall clock.
    """
    for _ in range(warmup):
        if before is not None:
            before()
        step()
    synchronize(device)
    times = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in progress(events, desc):
            if before is not None:
                before()
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in progress(range(reps), desc):
            if before is not None:
                before()
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def fmt(value) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "–"
    if isinstance(value, float):
        return f"{value:#.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_results(rows: list[dict], out_dir: str | Path, name: str, columns: list[str], title: str,
                  command: str, device: str, notes: list[str] = (), table_columns: list[str] | None = None) -> Path:
    """Write `<name>.parquet` (all `columns`), `<name>.md` (table, command, git sha, device, notes) and, where
    matplotlib is installed, `<name>.png` (bench/plot.py); return the md path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([{c: row.get(c) for c in columns} for row in rows])
    pq.write_table(table, out_dir / f"{name}.parquet")
    shas = sorted({str(row.get("git_sha") or git_sha()) for row in rows}) or [git_sha()]
    md = [f"# {title}", "", markdown_table(rows, table_columns or columns), "",
          f"Command: `{command}`", "", f"Git: {', '.join(shas)}", "", f"Device: {device}", ""]
    md += [f"- {note}" for note in notes]
    path = out_dir / f"{name}.md"
    path.write_text("\n".join(md).rstrip() + "\n")
    try:
        from bench.plot import PLOTS

        if name in PLOTS:
            PLOTS[name](out_dir / f"{name}.parquet", out_dir / f"{name}.png")
    except ImportError:  # no matplotlib (the GPU machine): python -m bench.plot later
        pass
    return path


def merge_by_config(old: list[dict], new: list[dict], config: tuple[str, ...]) -> list[dict]:
    """old's rows, each replaced by a new row of the same configuration (its values of `config`), then new's
    other rows."""
    def key(row):
        return tuple(row.get(c) for c in config)
    fresh = {key(r): r for r in new}
    kept = [fresh.pop(key(r), r) for r in old]
    return kept + list(fresh.values())
