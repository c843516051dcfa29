#!/usr/bin/env bash
# The GPU check as one command (see tests/gpu/README.md).
#
#   bash tests/gpu/run.sh --fetch      # here, where a package registry answers: the wheels into .whl/
#   bash tests/gpu/run.sh [OUT_DIR]    # on the GPU machine (no registry): install them, then run the check
#   bash tests/gpu/run.sh OUT_DIR --only step    # the same install, then those parts (check.py's options)
#
# The install adds the carried wheels and distsync itself to a folder of their own on PYTHONPATH
# ($DISTSYNC_GPU_SITE, default /tmp/distsync-gpu-site), without dependencies: the machine's torch and every
# other installed package stay as they are. The report goes to OUT_DIR, else $OUT, else ./gpu-check.
set -uo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
site=${DISTSYNC_GPU_SITE:-/tmp/distsync-gpu-site}
mapfile -t wanted < <(grep -v '^#' tests/gpu/wheels.txt | grep .)

fetch() {
    mkdir -p .whl
    local pure=() sdist=()
    for requirement in "${wanted[@]}"; do
        case $requirement in
            antlr4-python3-runtime*) sdist+=("$requirement") ;;  # published as an sdist only: built here
            *) pure+=("$requirement") ;;
        esac
    done
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "${pure[@]}" || return 1
    "$python" -m pip wheel -q --no-deps -w .whl "${sdist[@]}" || return 1
    ls .whl
}

have_wheels() {
    for requirement in "${wanted[@]}"; do
        local name=${requirement%%==*} version=${requirement#*==}
        compgen -G ".whl/${name//-/_}-${version}-*.whl" >/dev/null || return 1
    done
}

if [ "${1:-}" = "--fetch" ]; then
    fetch
    exit
fi
out=${1:-${OUT:-gpu-check}}
shift $(( $# > 0 ? 1 : 0 ))
if ! have_wheels; then
    echo "tests/gpu/run.sh: .whl/ lacks some of tests/gpu/wheels.txt; fetching them (needs a registry)"
    fetch || { echo "tests/gpu/run.sh: no wheels and no registry: run 'bash tests/gpu/run.sh --fetch' first"; exit 2; }
fi
wheels=()
for requirement in "${wanted[@]}"; do
    name=${requirement%%==*} version=${requirement#*==}
    wheels+=(.whl/"${name//-/_}-${version}"-*.whl)
done
started=$SECONDS
"$python" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target "$site" "${wheels[@]}" . || { echo "tests/gpu/run.sh: the install failed"; exit 2; }
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
(cd / && "$python" -c 'import distsync, hydra, torch; print("distsync from", distsync.__file__, "| hydra", hydra.__version__, "| torch", torch.__version__)') || exit 2
echo "installed in $((SECONDS - started)) s"
exec "$python" tests/gpu/check.py --out "$out" "$@"
