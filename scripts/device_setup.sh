#!/usr/bin/env bash
# Prepare a lent GPU machine (no network) to run splitspec from this checkout: install the
# carried wheels (.whl/, searched two folders down) of the dependencies it lacks, put the checkout
# on the path, and let the generated gRPC code (splitspec/v1, carried) accept the machine's own
# grpcio where it is older than the one the code was generated with (its version check is only a
# guard against old runtimes; carry grpcio-health-checking/-reflection wheels of that version).
# A module's path in the checkout is its import path (README, Layout), so nothing is copied or
# rearranged.
# Usage: source scripts/device_setup.sh
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(find .whl -maxdepth 2 -name '*.whl')
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
version=$(python3 -c "import grpc; print(grpc.__version__)")
sed -i "s/^GRPC_GENERATED_VERSION = .*/GRPC_GENERATED_VERSION = '$version'/" splitspec/v1/*_grpc.py
set +e
