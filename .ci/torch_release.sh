#!/usr/bin/env bash
# CI on another torch release, or another Python:
#
#   bash .ci/torch_release.sh TORCH_RELEASE [PYTHON]     # e.g. 2.4.1 3.10, or 2.14.1 3.13
#   bash .ci/torch_release.sh --torch-only TORCH_RELEASE [PYTHON]
#
# A venv of its own, made by Python PYTHON (X.Y: python X.Y on the PATH, else pyenv's X.Y.*; default
# python3), with torch==TORCH_RELEASE (a CUDA build from the registry, several GB, which imports and runs on
# the CPU) and the torchvision release built for it; then the self-check and the tests that make the drop-in
# claim on that release (layer, accuracy, conversion, subclasses, identity, the libraries and recipes,
# private APIs, compile, the fake-CUDA trace, a distsync.launch world, one packaged job) on two pytest-xdist
# processes. The venv is deleted afterwards.
#
# --torch-only installs that torch and torchvision into the venv and stops, leaving it for a later run
# (.ci/run installs the releases' builds while its main suite runs: unpacking one keeps a core busy for a
# minute or two). A venv whose torch install finished holds the file .torch-installed and is kept;
# anything else there is made anew. distsync itself is always installed by the run that tests it.
set -euo pipefail
cd "$(dirname "$0")/.."

torch_only=
if [ "${1:-}" = --torch-only ]; then
    torch_only=1
    shift
fi
release="${1:?usage: .ci/torch_release.sh [--torch-only] TORCH_RELEASE [PYTHON], e.g. 2.14.1 3.13}"
want_python="${2:-}"
# torch 2.x.y pairs with torchvision 0.(x+15).y: each torchvision release from 0.19.0 to 0.29.1 requires
# that torch release (0.29.x: torch >= 2.14.0). distsync needs torch >= 2.4.
if [[ ! "$release" =~ ^2\.([0-9]+)\.([0-9]+)$ ]] || ((BASH_REMATCH[1] < 4)); then
    echo "torch release $release: give one of 2.4.0 and later, as X.Y.Z" >&2
    exit 2
fi
vision="0.$((BASH_REMATCH[1] + 15)).${BASH_REMATCH[2]}"

python=python3
if [ -n "$want_python" ]; then
    python=
    for candidate in "python$want_python" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$want_python".*/bin/python; do
        if [ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$want_python" ]; then
            python=$candidate
            break
        fi
    done
    if [ -z "$python" ]; then
        echo "no Python $want_python here: neither python$want_python nor pyenv's $want_python.*" >&2
        exit 2
    fi
fi

venv=".venv-torch-$release${want_python:+-py$want_python}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
started=$SECONDS
if [ ! -f "$venv/.torch-installed" ]; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q "torch==$release" "torchvision==$vision"
    touch "$venv/.torch-installed"
fi
if [ -n "$torch_only" ]; then
    echo "torch $release and torchvision $vision in $venv after $((SECONDS - started)) s"
    exit 0
fi
trap 'rm -rf "$venv"' EXIT
# shellcheck disable=SC1091
. "$venv/bin/activate"
pip install -q "torch==$release" "torchvision==$vision" -e ".[test]"
python -c "import platform, torch, torchvision
print('Python', platform.python_version(), '| torch', torch.__version__, '| torchvision', torchvision.__version__)"
echo "installed in $((SECONDS - started)) s"

python -m distsync.check --nproc 2
python -m pytest -q -n 2 -p no:cacheprovider \
    tests/test_batchnorm.py tests/test_accuracy.py tests/test_convert.py tests/test_subclass.py \
    tests/test_layer_semantics.py tests/test_identity.py tests/test_libraries.py tests/test_private_apis.py \
    tests/test_ddp.py tests/test_compile.py tests/test_checkpointing.py tests/test_recipes.py tests/test_cuda_trace.py \
    "tests/test_elastic.py::test_launch_returns_rank_zeros_value" \
    "tests/test_elastic.py::test_ranks_that_end_without_a_result_leave_rank_zeros_value" \
    "tests/test_launch.py::test_single_run_from_repo_root"
echo "torch $release on Python $(python -c 'import platform; print(platform.python_version())'): done in $((SECONDS - started)) s"
