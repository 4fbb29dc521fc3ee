#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/stepwatch.sh): tell this node's stepwatch agent the job
# ended, with SLURM_JOB_EXIT_CODE2 and its state (docs/baremetal.md). Pass --state from an EpilogSlurmctld
# that knows the final state (slurmd's Epilog reads COMPLETING).
STEPWATCH_SOCKET_DIR=${STEPWATCH_SOCKET_DIR:-/run/stepwatch} python3 -m stepwatch.agents.slurm epilog || true
exit 0
