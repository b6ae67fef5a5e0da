#!/usr/bin/env bash
# The checks a session runs when its task is lent a GPU machine (the `device` tool): the KV
# tiering's tests on CUDA tensors and the copier's benchmark. That machine has PyTorch but no
# vLLM and no network, so nothing is installed: the packages are laid out as pyproject's
# package-dir maps them, and the tests run without tests/conftest.py (it needs the server's
# dependencies). Writes its logs and JSON under $OUT (or ./gpu-check-out).
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
repo=$PWD
site=$(mktemp -d)/site
work=$(mktemp -d)
mkdir -p "$site"
cp -r "$repo/antiphon" "$site/antiphon"
for pkg in server sessions tiering engine_ext web_ui agents bench; do
    cp -r "$repo/$pkg" "$site/antiphon/$pkg"
done
cp -r "$repo/tests" "$work/tests"
# The connector's metadata classes derive from vLLM's two base classes, all that this code needs
# of vLLM: stand-ins where vLLM is missing.
if ! python3 -c 'import vllm' 2>/dev/null; then
    base=$site/vllm/distributed/kv_transfer/kv_connector/v1
    mkdir -p "$base"
    for d in vllm vllm/distributed vllm/distributed/kv_transfer \
             vllm/distributed/kv_transfer/kv_connector "${base#"$site/"}"; do
        touch "$site/$d/__init__.py"
    done
    printf 'class KVConnectorMetadata:\n    pass\n\n\nclass KVConnectorWorkerMetadata:\n    pass\n' \
        > "$base/base.py"
fi
rm -f "$work/tests/conftest.py"
export PYTHONPATH=$site PYTHONUNBUFFERED=1
{ nvidia-smi -L || true; python3 -V; python3 -c 'import torch; print("torch", torch.__version__,
  "cuda", torch.cuda.is_available())'; } 2>&1 | tee "$OUT/machine.txt"

status=0
# Tiering tests that need neither vLLM nor the server (tests/test_tier_copier.py runs on CUDA
# tensors as well as CPU ones where a GPU is present).
(cd "$work" && python3 -m pytest -q -p no:cacheprovider \
    tests/test_tier_copier.py tests/test_bench_page_copies.py tests/test_tier_host.py \
    tests/test_tier_ssd.py tests/test_tier_eviction.py tests/test_tier_keys.py \
    tests/test_tier_manager.py tests/test_tier_planner.py tests/test_tier_property.py \
    --deselect tests/test_tier_planner.py::test_every_counter_is_exported_to_prometheus) \
    2>&1 | tee "$OUT/tests.log" || status=1
(cd "$work" && python3 -m antiphon.bench.page_copies --movers batched --repeats 3 \
    --out "$OUT/page_copies.json") 2>&1 | tee "$OUT/page_copies.log" || status=1
exit $status
