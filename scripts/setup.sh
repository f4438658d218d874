#!/usr/bin/env bash
# Create (or reuse) .venv and install SpaceServe into it for development: `pip install -e .[dev]`.
#
# One line per step. The venv sees the system's site-packages, so a CUDA build of torch already
# installed is kept; torch 2.13.0 is installed only when no torch can be imported. Override it
# with SPACESERVE_TORCH (a pip requirement) and SPACESERVE_TORCH_INDEX (a pip index URL, e.g.
# PyTorch's CPU wheel index on a machine whose default torch would be a CUDA build).
#
# pip runs with its own output (what it collects, downloads and installs), minus the noise it
# repeats per package: "Requirement already satisfied" lines, warnings about index folders that
# lack a package (a local multi-folder index prints one per package per folder), and its failed
# attempts to uninstall the system packages the venv shadows; each kind is counted in one line
# instead. Errors and every other warning are shown.
#
# A second run with nothing to do takes seconds: the editable install is skipped while the stamp
# .venv/.spaceserve-setup (a hash of pyproject.toml and the torch request) is current and the
# package and its dev dependencies import. `bash scripts/setup.sh --force` reinstalls anyway.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
VPY=.venv/bin/python
STAMP=.venv/.spaceserve-setup
TORCH_REQ="${SPACESERVE_TORCH:-torch==2.13.0}"
FORCE=0
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "setup: unknown argument $arg (use --force or --help)" >&2; exit 2 ;;
  esac
done
START=$SECONDS

say() { echo "setup: $*"; }

# pip's output through a filter: the two repeated kinds of noise counted, the rest passed on.
quiet_filter() {
  awk '
    /^WARNING: Location .* is ignored: it is neither a file nor a directory\.?$/ { loc++; next }
    /^Requirement already satisfied: / { sat++; next }
    # a system package the venv shadows: pip tries to uninstall it, then says it cannot
    /^ *Attempting uninstall: / { held = $0; next }
    /^ *Found existing installation: / && held != "" { held = held "\n" $0; next }
    /^ *Not uninstalling .* outside environment/ { shadow++; held = ""; next }
    /^ *Can.t uninstall .*No files were found to uninstall\.?$/ { next }
    { if (held != "") { print held; held = "" } print; fflush() }
    END {
      if (held != "") print held
      if (sat) printf "setup: (%d requirements already satisfied)\n", sat
      if (shadow) printf "setup: (%d packages of the system site-packages shadowed by newer ones in .venv)\n", shadow
      if (loc) printf "setup: (%d pip warnings about index folders without the package hidden)\n", loc
    }'
}
pip_install() {  # pip_install ARGS...: pip install with its progress, filtered; pip's exit status
  local rc=0
  "$VPY" -m pip --disable-pip-version-check install --progress-bar on "$@" 2>&1 \
    | quiet_filter || rc=$?
  return "$rc"
}

# What the venv holds, seen from outside the source tree (-I: no cwd, no PYTHONPATH). torch is
# imported (a broken install counts as missing); the rest is only looked up.
probe() {
  "$VPY" -I - "$PWD" <<'EOF'
import importlib.metadata as md, importlib.util, os, sys
root = sys.argv[1]
try:
    import torch
    print("torch", torch.__version__, torch.cuda.is_available())
except Exception as exc:  # absent or broken: reinstall
    print("torch-missing", type(exc).__name__)
spec = importlib.util.find_spec("spaceserve")
here = spec is not None and os.path.realpath(spec.origin or "").startswith(os.path.realpath(root))
print("spaceserve", "ok" if here else "missing")
dev = ["triton", "transformers", "safetensors", "numpy", "pytest", "pytest_benchmark", "ruff",
       "fastapi", "uvicorn", "httpx", "openai", "PIL", "matplotlib", "av", "ray"]
print("missing", " ".join(m for m in dev if importlib.util.find_spec(m) is None) or "-")
versions = []
for dist in ("triton", "transformers", "fastapi", "uvicorn", "openai", "ray"):
    try:
        versions.append(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        versions.append(f"{dist} absent")
print("versions", ", ".join(versions))
EOF
}

if [ -x "$VPY" ]; then
  say "1/4 .venv exists ($("$VPY" -c 'import sys; print(sys.version.split()[0])'))"
else
  say "1/4 creating .venv with $("$PY" -c 'import sys; print(sys.version.split()[0])') (sees the system's site-packages)"
  "$PY" -m venv --system-site-packages .venv
fi

state=$(probe)
if grep -q '^torch-missing' <<<"$state"; then
  say "2/4 no torch in the venv: installing $TORCH_REQ (the largest download; pip's progress follows)"
  pip_install ${SPACESERVE_TORCH_INDEX:+--index-url "$SPACESERVE_TORCH_INDEX"} "$TORCH_REQ"
  state=$(probe)
else
  say "2/4 torch $(awk '/^torch /{print $2" found (CUDA available: "$3")"}' <<<"$state")"
fi

key=$( { cat pyproject.toml; echo "$TORCH_REQ ${SPACESERVE_TORCH_INDEX:-}"; } | sha256sum | cut -c1-16)
missing=$(awk '/^missing /{ $1=""; print substr($0, 2) }' <<<"$state")
if [ "$FORCE" = 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$key" ] \
    && grep -q '^spaceserve ok' <<<"$state" && [ "$missing" = "-" ] && [ -x .venv/bin/spaceserve ]; then
  say "3/4 spaceserve and its dev dependencies are installed for this pyproject.toml: nothing to do"
else
  why="pyproject.toml changed or first install"
  [ "$FORCE" = 1 ] && why="--force"
  [ "$missing" != "-" ] && [ -n "$missing" ] && why="missing: $missing"
  say "3/4 pip install -e .[dev] ($why)"
  rm -f "$STAMP"
  pip_install -e ".[dev]"
  state=$(probe)
  if ! grep -q '^spaceserve ok' <<<"$state"; then
    say "spaceserve does not import from this checkout after the install" >&2
    exit 1
  fi
  echo "$key" > "$STAMP"
fi

say "4/4 $(awk '/^torch /{print "torch "$2", CUDA available: "$3}' <<<"$state"); $(awk '/^versions /{ $1=""; print substr($0, 2) }' <<<"$state")"
say "done in $((SECONDS - START)) s: .venv/bin/spaceserve, .venv/bin/python -m pytest -q"
