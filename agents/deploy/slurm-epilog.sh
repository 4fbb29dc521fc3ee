#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/stepwatch.sh): tell this node's stepwatch agent the job
# ended, with SLURM_JOB_EXIT_CODE2 and its state (docs/baremetal.md). It returns at once: the job reads
# COMPLETING until the epilogs are done, so a detached child sends the end once Slurm has settled the state
# (CANCELLED, TIMEOUT, ...; at most --wait-s, 60 s, later).
STEPWATCH_SOCKET_DIR=${STEPWATCH_SOCKET_DIR:-/run/stepwatch} python3 -m stepwatch.agents.slurm epilog || true
exit 0
