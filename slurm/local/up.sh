#!/usr/bin/env bash
# A real Slurm cluster on this one machine: munge, slurmctld and two slurmd (nodes n1, n2),
# every state, spool, log and pid file under STATE_DIR. Prints STATE_DIR; clients find the
# cluster through SLURM_CONF=STATE_DIR/slurm.conf (source STATE_DIR/env.sh).
#
#   slurm/local/up.sh [STATE_DIR]     (needs root, and: apt-get install --no-install-recommends
#   slurm/local/down.sh STATE_DIR      slurmctld slurmd slurm-client munge)
set -euo pipefail
STATE=${1:-$(mktemp -d /tmp/megaloop-slurm.XXXXXX)}
mkdir -p "$STATE"/{state,log,spool/n1,spool/n2}
STATE=$(cd "$STATE" && pwd)
for tool in munged slurmctld slurmd sinfo; do
  command -v "$tool" >/dev/null || { echo "up.sh: $tool not found; apt-get install --no-install-recommends slurmctld slurmd slurm-client munge" >&2; exit 2; }
done

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
CTLD_PORT=$(free_port); N1_PORT=$(free_port); N2_PORT=$(free_port)
for port in "$CTLD_PORT" "$N1_PORT" "$N2_PORT"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "up.sh: port $port is taken; run again" >&2; exit 2
  fi
done

# munge with its own key, socket and pid file
dd if=/dev/urandom of="$STATE/munge.key" bs=1024 count=1 status=none
chmod 0400 "$STATE/munge.key"
munged --force --key-file="$STATE/munge.key" --socket="$STATE/munge.socket" \
  --pid-file="$STATE/munged.pid" --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge.seed"

CPUS=$(nproc)
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 4 ))
cat > "$STATE/slurm.conf" <<CONF
ClusterName=megaloop-local
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$STATE/munge.socket,cred_expire=5
CredType=cred/munge
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
JobRequeue=1
KillWait=10
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$N1_PORT CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$N2_PORT CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
echo "export SLURM_CONF=$STATE/slurm.conf" > "$STATE/env.sh"
export SLURM_CONF="$STATE/slurm.conf"

slurmctld -D -f "$SLURM_CONF" > "$STATE/log/slurmctld.out" 2>&1 &
echo $! > "$STATE/slurmctld.launcher.pid"
for node in n1 n2; do
  slurmd -D -N "$node" -f "$SLURM_CONF" > "$STATE/log/slurmd-$node.out" 2>&1 &
  echo $! > "$STATE/slurmd-$node.launcher.pid"
done

for _ in $(seq 100); do
  if [ "$(sinfo -h -N -o '%T' 2>/dev/null | grep -c idle)" = 2 ]; then
    echo "$STATE"
    exit 0
  fi
  sleep 0.2
done
echo "up.sh: the nodes did not come up; see $STATE/log" >&2
"$(dirname "$0")/down.sh" "$STATE" >&2 || true
exit 1
