#!/bin/bash
# One device call: the real runs on CUDA, spooled by a node agent that cannot reach Kafka; the spool comes back.
# Run from the repository root on a lent GPU machine with kafka-python and crc32c wheels in .whl/ (docs/eval.md,
# "GPU runs"); then `stepwatch eval --real --spool <the spool unpacked from $OUT/spool.tgz>` here.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; R=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
T=/tmp/sw; mkdir -p $T/stepwatch; for f in $R/stepwatch/*; do ln -s $f $T/stepwatch/; done
for d in agents stream detectors storage dashboards; do ln -s $R/$d $T/stepwatch/$d; done
I=$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])"); X=$(python3 -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")
gcc -O2 -shared -fPIC -I$I $R/agents/probe/_probefast*.c -o $R/agents/probe/_probefast$X || echo "no C path"
cd /tmp   # (from the repository's root, its partial stepwatch/ folder would shadow the tree)
export PYTHONPATH=$T:/tmp/site PYTHONUNBUFFERED=1
python3 -c "import stepwatch.agents.probe._probefast as f; print('C path', f.arm_exit)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S=/tmp/swsock; mkdir -p $S
timeout 400 python3 -m stepwatch.cli agent --bootstrap 127.0.0.1:9 --socket-dir $S --spool-dir $OUT/spool --node gpu0 --interval 0.5 --no-profiling > $OUT/agent.log 2>&1 &
AG=$!; sleep 3
W="python3 -m stepwatch.agents.wrap --socket-dir $S"
run() { name=$1; shift; echo "== $name $(date +%T)"; env SW_DEVICE=cuda SW_PAD_MS=0 SW_WIDTH=4096 SW_BATCH=4096 "$@" timeout 120 $W --job $name -- python3 $R/stepwatch/devtools/ddp_train.py > $OUT/$name.log 2>&1; echo "rc=$? $(date +%T)"; tail -2 $OUT/$name.log; sleep 4; }
run g-clean-nccl-1 SW_NPROC=1 SW_BACKEND=nccl SW_STEPS=400
run g-clean-gloo-2 SW_NPROC=2 SW_STEPS=400
run g-sleep-r1 SW_NPROC=2 SW_STEPS=400 SW_SLEEP_RANK=1 SW_SLEEP_MS=15 SW_SLEEP_FROM=200
run g-crash-r1 SW_NPROC=2 SW_STEPS=400 SW_CRASH_RANK=1 SW_CRASH_STEP=200
run g-raise-r1 SW_NPROC=2 SW_STEPS=400 SW_CRASH_RANK=1 SW_CRASH_STEP=200 SW_CRASH_HOW=raise
echo "== g-hang-r1 $(date +%T)"
env SW_DEVICE=cuda SW_PAD_MS=0 SW_WIDTH=4096 SW_BATCH=4096 SW_NPROC=2 SW_STEPS=400 SW_HANG_RANK=1 SW_HANG_STEP=200 SW_HANG_S=600 setsid $W --job g-hang-r1 -- python3 $R/stepwatch/devtools/ddp_train.py > $OUT/g-hang-r1.log 2>&1 &
HP=$!; sleep 55; kill -9 -- -$HP 2>/dev/null; pkill -9 -f ddp_train.py; echo "killed $(date +%T)"
sleep 15
kill -INT $AG; sleep 4
du -sh $OUT/spool; ls $OUT/spool | wc -l
cd $OUT && tar czf spool.tgz spool && rm -rf spool
grep -v ECONN $OUT/agent.log | tail -3
