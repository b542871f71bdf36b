#!/usr/bin/env bash
# A real Slurm on this one host, for tests, CI and trying `gyre-hpc submit` on a laptop:
# munge, MariaDB + slurmdbd (so sacct works), slurmctld and NODES emulated slurmd nodes.
#
#   tools/local_slurm.sh start   # idempotent: starts only what is not running yet
#   tools/local_slurm.sh stop    # stops only what `start` started
#   tools/local_slurm.sh status
#
# Settings that matter on one host (docs/ARCHITECTURE.md, §10): one slurmd per emulated node with its own
# Port and %n paths, TmpFS per node (else PMIx directories collide and ranks hang in MPI_Init),
# config_overrides to declare more CPUs than exist, backfill that starts het jobs at once, and a
# task prolog that keeps Open MPI's shared-memory transport out of the way (see task_prolog).
# It writes /etc/slurm/slurm.conf only when there is none or the one there is ours.
set -euo pipefail

NODES=${GYRE_SLURM_NODES:-5}
CPUS=${GYRE_SLURM_CPUS:-8}
CLUSTER=gyre
MARK="# written by gyre-hpc tools/local_slurm.sh"
STATE=/var/lib/gyre-slurm
LOGS=/var/log/gyre-slurm
RUN=/run/gyre-slurm
STARTED=$RUN/started          # one line per service this script started

say() { printf 'local-slurm: %s\n' "$*"; }
die() { printf 'local-slurm: error: %s\n' "$*" >&2; exit 1; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
started() { mkdir -p "$RUN"; grep -qx "$1" "$STARTED" 2>/dev/null || echo "$1" >>"$STARTED"; }

write_conf() {
  local conf=/etc/slurm/slurm.conf dbd=/etc/slurm/slurmdbd.conf
  if [ -f "$conf" ] && ! grep -qF "$MARK" "$conf"; then
    die "$conf exists and is not ours; refusing to replace a real Slurm configuration"
  fi
  mkdir -p /etc/slurm "$STATE" "$LOGS" "$RUN"
  cat >"$conf" <<CONF
$MARK
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
SlurmctldPort=16817
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd-%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
TmpFS=/tmp/slurm-%n
TaskProlog=$STATE/task-prolog.sh
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,bf_hetjob_immediate
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
MinJobAge=300
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=16819
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=node[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[17001-$((17000 + NODES))] CPUs=$CPUS RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
  task_prolog >"$STATE/task-prolog.sh"
  chmod 755 "$STATE/task-prolog.sh"
  cat >"$dbd" <<CONF
$MARK
AuthType=auth/munge
DbdHost=localhost
DbdPort=16819
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOGS/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=gyre-local
StorageLoc=gyre_slurm_acct
CONF
  chmod 600 "$dbd"
}

# Emulated nodes share one host. With two tasks on an emulated node, Open MPI's shared-memory
# transport (vader) gets two views of which ranks are local (PMIx: those of the emulated node;
# hostnames: every rank) and crashes in MPI_Comm_split. On one host, TCP over loopback does.
# pml ob1: there is no InfiniBand here, so the UCX pml only probes every UCX transport in MPI_Init
# and declines; that probe, with two jobs starting at once, has segfaulted inside libucs. Windows
# still need osc/ucx (its context is made at the first window, not in MPI_Init).
task_prolog() {
  printf '#!/bin/sh\n%s\necho "export OMPI_MCA_btl=self,tcp"\necho "export OMPI_MCA_pml=ob1"\n' "$MARK"
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  [ -f /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge && chown munge:munge /run/munge
  runuser -u munge -- /usr/sbin/munged
  started munge
  for _ in $(seq 50); do munge -n </dev/null | unmunge >/dev/null 2>&1 && return; sleep 0.1; done
  die "munged did not come up"
}

start_mariadb() {
  if ! mysqladmin ping >/dev/null 2>&1; then
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    (setsid mysqld_safe >/dev/null 2>&1 &)
    started mariadb
    for _ in $(seq 100); do mysqladmin ping >/dev/null 2>&1 && break; sleep 0.2; done
    mysqladmin ping >/dev/null 2>&1 || die "MariaDB did not come up"
  fi
  mysql -u root <<SQL
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'gyre-local';
GRANT ALL ON gyre_slurm_acct.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
SQL
}

start_slurmdbd() {
  alive "$RUN/slurmdbd.pid" && return
  slurmdbd; started slurmdbd
  for _ in $(seq 100); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.2; done
  sacctmgr -n list cluster format=cluster | grep -qw "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
}

start_slurm() {
  if ! alive "$RUN/slurmctld.pid"; then slurmctld; started slurmctld; fi
  for i in $(seq "$NODES"); do
    mkdir -p "/tmp/slurm-node$i" "$STATE/slurmd-node$i"
    alive "$RUN/slurmd-node$i.pid" && continue
    slurmd -N "node$i"; started "slurmd-node$i"
  done
  for _ in $(seq 150); do
    idle=$(sinfo -h -N -t idle,mix,alloc -o %N 2>/dev/null | sort -u | wc -l)
    [ "$idle" -ge "$NODES" ] && return
    scontrol update nodename="node[1-$NODES]" state=resume >/dev/null 2>&1 || true
    sleep 0.2
  done
  die "nodes did not become idle; see $LOGS"
}

stop_pidfile() { alive "$1" && kill "$(cat "$1")" 2>/dev/null || true; }

cmd=${1:-start}
case "$cmd" in
  start)
    command -v slurmctld >/dev/null || die "Slurm is not installed: run tools/setup.sh first"
    write_conf; start_munge; start_mariadb; start_slurmdbd; start_slurm
    say "ready: $(sinfo -h -o '%D nodes %T' | paste -sd ', ')" ;;
  stop)
    [ -f "$STARTED" ] || { say "nothing to stop"; exit 0; }
    for i in $(seq "$NODES"); do grep -qx "slurmd-node$i" "$STARTED" && stop_pidfile "$RUN/slurmd-node$i.pid"; done
    grep -qx slurmctld "$STARTED" && stop_pidfile "$RUN/slurmctld.pid"
    grep -qx slurmdbd "$STARTED" && stop_pidfile "$RUN/slurmdbd.pid"
    grep -qx mariadb "$STARTED" && { mysqladmin shutdown 2>/dev/null || true; }
    grep -qx munge "$STARTED" && { pkill -x munged || true; }
    rm -f "$STARTED"; say "stopped" ;;
  status)
    sinfo 2>&1 || true ;;
  *) die "unknown command '$cmd' (valid: start, stop, status)" ;;
esac
