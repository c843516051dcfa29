#!/usr/bin/env bash
# CI on another torch release: a venv of its own with torch==$1 (a CUDA build from the registry, several GB,
# which imports and runs on the CPU), the self-check and the tests that make the drop-in claim on that
# release (layer, accuracy, conversion, subclasses, identity, the libraries and recipes, private APIs,
# compile, a distsync.launch world, one packaged job). The venv is deleted afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."

release="$1"
case "$release" in  # the torchvision release built for each torch release
    2.4.*) vision="0.19.${release##*.}" ;;
    2.14.*) vision="0.29.${release##*.}" ;;
    *) echo "no torchvision release known for torch $release" >&2; exit 2 ;;
esac
venv=".venv-torch-$release"
rm -rf "$venv"
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q "torch==$release" "torchvision==$vision"
pip install -q "torch==$release" "torchvision==$vision" -e ".[test]"
python -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"

python -m distsync.check --nproc 2
python -m pytest -q -p no:cacheprovider \
    tests/test_batchnorm.py tests/test_accuracy.py tests/test_convert.py tests/test_subclass.py \
    tests/test_layer_semantics.py tests/test_identity.py tests/test_libraries.py tests/test_private_apis.py \
    tests/test_ddp.py tests/test_compile.py tests/test_checkpointing.py tests/test_recipes.py \
    "tests/test_elastic.py::test_launch_returns_rank_zeros_value" \
    "tests/test_elastic.py::test_ranks_that_end_without_a_result_leave_rank_zeros_value" \
    "tests/test_launch.py::test_single_run_from_repo_root"
