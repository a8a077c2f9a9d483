#!/usr/bin/env bash
# Compile the Triton kernels that the SM90 tables launch, for sm_90a, under each supported Triton release.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: bash benchmarks/compile_matrix.sh [--releases "3.6 3.7 3.8 3.9"] [--venvs DIR] [--torch VERSION]
                                         [-- COMPILE_SM90_ARGS...]

Builds (or reuses) one virtual environment per Triton release, with torch, that release of Triton and
this package (editable, without dependencies), and runs benchmarks/compile_sm90.py in each: the
variants the SM90 tables launch, compiled for sm_90a without a GPU. Prints each release's summary
line, then all of them together; exits 1 if any variant failed to compile under any release.

Options:
  --releases LIST   Triton releases (major.minor), space-separated (default: the supported ones,
                    mla_ops.kernels.triton_compat.SUPPORTED_RELEASES)
  --venvs DIR       where the environments live, one per release: DIR/mla-ops-triton-X.Y
                    (default: ${TMPDIR:-/tmp})
  --torch VERSION   the torch installed in each (default 2.13.0). Its own Triton pin may differ from
                    the release asked for; compiling does not need the two to match, and the release
                    asked for is installed after it and checked.
  -h, --help        this text
  -- ARGS           passed on to compile_sm90.py (e.g. -- --allow-spills, or -- --configs "128,64,8,3")

Needs network access (or a package index holding those releases) the first time an environment is built.
EOF
}

root="$(cd "$(dirname "$0")/.." && pwd)"
releases=""
venvs="${TMPDIR:-/tmp}"
torch_version="2.13.0"
compile_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --) shift; compile_args=("$@"); break ;;
        --releases) releases="$2"; shift 2 ;;
        --venvs) venvs="$2"; shift 2 ;;
        --torch) torch_version="$2"; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "compile_matrix.sh: unknown argument '$1'; see --help" >&2; exit 2 ;;
    esac
done
if [ -z "$releases" ]; then
    # The module reads no Triton: any Python 3 can print the supported releases.
    releases="$(cd "$root" && python3 -c 'import importlib.util as u, sys
spec = u.spec_from_file_location("compat", "mla_ops/kernels/triton_compat.py")
m = u.module_from_spec(spec); spec.loader.exec_module(m); print(" ".join(m.SUPPORTED_RELEASES))')"
fi

summaries=()
status=0
for release in $releases; do
    venv="$venvs/mla-ops-triton-$release"
    echo "=== Triton $release ($venv)"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
    fi
    # torch first, then the Triton release asked for, which replaces whatever torch pinned.
    "$venv/bin/python" -m pip install -q "torch==$torch_version" numpy
    "$venv/bin/python" -m pip install -q "triton==$release.*"
    "$venv/bin/python" -m pip install -q --no-deps -e "$root"
    installed="$("$venv/bin/python" -c 'import triton; print(triton.__version__)')"
    case "$installed" in
        "$release".*) ;;
        *)
            echo "compile_matrix.sh: asked for Triton $release, but $venv holds $installed" >&2
            summaries+=("Triton $release: not installed ($installed instead)")
            status=1
            continue
            ;;
    esac
    set +e
    output="$(cd "$root" && "$venv/bin/python" benchmarks/compile_sm90.py "${compile_args[@]}" 2>"$venv/compile_sm90.stderr")"
    rc=$?
    set -e
    echo "$output"
    if [ "$rc" -gt 1 ]; then  # it could not compile at all: say why
        tail -n 5 "$venv/compile_sm90.stderr" >&2
        summaries+=("Triton $release: compile_sm90.py exited with status $rc")
    else
        summaries+=("$(echo "$output" | tail -n 1)")
    fi
    [ "$rc" -eq 0 ] || status=1
done

echo "=== summary"
printf '%s\n' "${summaries[@]}"
exit "$status"
