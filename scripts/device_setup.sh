#!/usr/bin/env bash
# Prepare a lent GPU machine (no network) to run splitspec from this checkout: install the
# carried wheels (.whl/) of the dependencies it lacks, and put the checkout on the path. A module's
# path in the checkout is its import path (README, Layout), so nothing is copied or rearranged.
# Usage: source scripts/device_setup.sh   (needs splitspec/v1 generated here and carried)
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
set +e
