#!/usr/bin/env bash
# A one-node Slurm on this host, to compare corral's commands with Slurm's side by side (the CLI
# bench's CORRAL_BENCH_SLURM=1). Needs root and Debian's packages: apt-get install slurmctld
# slurmd munge slurm-client.
#
#   scripts/slurm-local.sh start DIR   writes DIR/slurm.conf, starts munged (if none runs),
#                                      slurmctld and slurmd, waits until the node is idle
#   scripts/slurm-local.sh stop DIR    stops what start started
#
# Then: export SLURM_CONF=DIR/slurm.conf (start prints it).
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  echo "usage: $0 start|stop DIR" >&2
  exit 2
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
conf=$dir/slurm.conf

stop() {
  for daemon in slurmd slurmctld munged; do
    pidfile=$dir/$daemon.pid
    if [ -s "$pidfile" ]; then
      pid=$(cat "$pidfile")
      # Only the daemon that file names: a stale file may name a process that reused its pid.
      if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$daemon" ]; then
        kill "$pid" 2>/dev/null || true
      fi
      rm -f "$pidfile"
    fi
  done
}

case "$cmd" in
stop)
  stop
  exit 0
  ;;
start) ;;
*)
  echo "usage: $0 start|stop DIR" >&2
  exit 2
  ;;
esac

for tool in slurmctld slurmd munged scontrol; do
  command -v "$tool" >/dev/null || {
    echo "$tool not found: apt-get install slurmctld slurmd munge slurm-client" >&2
    exit 1
  }
done
host=$(hostname -s)
mkdir -p "$dir/state" "$dir/spool"
cat >"$conf" <<EOF
ClusterName=bench
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
MaxJobCount=200000
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=$host CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

if ! pgrep -x munged >/dev/null; then
  mkdir -p /run/munge
  munged --force --pid-file="$dir/munged.pid" 2>/dev/null
fi
export SLURM_CONF=$conf
slurmctld -c -f "$conf"
slurmd -f "$conf"
for _ in $(seq 1 100); do
  if scontrol show node "$host" 2>/dev/null | grep -q "State=IDLE"; then
    echo "export SLURM_CONF=$conf"
    exit 0
  fi
  sleep 0.2
done
echo "slurm did not become ready; logs: $dir/slurmctld.log $dir/slurmd.log" >&2
stop
exit 1
