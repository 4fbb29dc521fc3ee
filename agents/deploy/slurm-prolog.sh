#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/stepwatch.sh): tell this node's stepwatch agent the
# job started (docs/baremetal.md). Never fails the job: a prolog that exits non-zero drains the node.
STEPWATCH_SOCKET_DIR=${STEPWATCH_SOCKET_DIR:-/run/stepwatch} python3 -m stepwatch.agents.slurm prolog || true
exit 0
