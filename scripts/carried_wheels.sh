# Sourced by scripts/gpu_bench.sh and scripts/gpu_smoke.sh on a lent GPU: install the wheels carried in .whl/ (the
# packages the GPU image lacks; nothing is downloadable there) into /tmp/site, and put them and the repo on PYTHONPATH.
install_carried_wheels() {
    if compgen -G ".whl/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || return 1
        export PYTHONPATH=/tmp/site:$PWD
    else
        export PYTHONPATH=$PWD
    fi
}
