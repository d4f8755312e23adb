#!/usr/bin/env bash
# Prepare a lent GPU machine (no network) to run splitspec from this checkout: install the
# carried wheels (.whl/) and lay the package out as `pip install .` would, without building.
# Usage: source scripts/device_setup.sh   (needs splitspec/v1 generated here and carried)
# It leaves you in /tmp/pkg, so that `python3 -m splitspec` cannot pick up the uninstalled
# checkout; the checkout is $SPLITSPEC_SRC.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
rm -rf /tmp/pkg && mkdir -p /tmp/pkg
cp -r splitspec /tmp/pkg/ && cp -r services /tmp/pkg/splitspec/services && cp -r native /tmp/pkg/splitspec/native
export SPLITSPEC_SRC=$PWD
export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD/tests
cd /tmp/pkg
set +e
