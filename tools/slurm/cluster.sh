#!/usr/bin/env bash
# A real single-host Slurm 22.05 cluster for tests and CI: munge, MariaDB, slurmdbd, slurmctld and
# four slurmd (multiple-slurmd: nodes n[1-4] on localhost, CPUs=4 RealMemory=4000 Gres=gpu:2 each,
# overstated with config_overrides; the "GPUs" are /dev/null-like character devices).
#
#   bash tools/slurm/cluster.sh start DIR    # configs, state, DB and logs under DIR; last line:
#                                            #   export SLURM_CONF=DIR/slurm.conf
#   bash tools/slurm/cluster.sh status DIR   # sinfo
#   bash tools/slurm/cluster.sh stop DIR     # cancel jobs, stop every daemon of this cluster
#
# Partitions: debug (default, PriorityTier=1, PreemptMode=REQUEUE, GraceTime=15) and high
# (PriorityTier=2, PreemptMode=OFF). A job in high preempts jobs in debug; with
# preempt_send_user_signal the victim first gets its --signal (B: = the batch shell only).
# Needs root and the packages of tools/slurm/install.sh. Sockets, spool and pid files live under
# /run/relax-slurm/<hash of DIR> (unix socket paths must stay short); logs in DIR/log.
# Environment: RELAX_SLURM_PORT_BASE (default: the first of 16800, 17800, ... whose ports are free;
# slurmctld BASE+17, slurmdbd BASE+19, slurmd BASE+21..BASE+24);
# RELAX_SLURM_KEEP_ON_FAIL=1 leaves the daemons running when start fails (to debug);
# RELAX_SLURM_ACCOUNTING=none: no MariaDB, no slurmdbd (AccountingStorageType=accounting_storage/none,
# as on clusters without accounting: sacct answers nothing);
# RELAX_SLURM_MIN_JOB_AGE=SECONDS (default 86400): how long slurmctld remembers an ended job (a few
# seconds lets a test see Slurm forget one).
set -euo pipefail

usage() { echo "usage: $0 start|stop|status DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
CMD=$1
DIR=$(realpath -m -- "$2")

export USER=${USER:-$(id -un)}
export LOGNAME=${LOGNAME:-$USER}
export SLURM_CONF=$DIR/slurm.conf
unset SLURM_JOB_ID SLURM_JOBID

CLUSTER_NAME=relax
ACCOUNTING=${RELAX_SLURM_ACCOUNTING:-slurmdbd}
case $ACCOUNTING in slurmdbd | none) ;; *) echo "RELAX_SLURM_ACCOUNTING: slurmdbd or none, not $ACCOUNTING" >&2 && exit 2 ;; esac
MIN_JOB_AGE=${RELAX_SLURM_MIN_JOB_AGE:-86400}
NODES=(n1 n2 n3 n4)
set_ports() {  # BASE
  PORT_BASE=$1
  CTLD_PORT=$((PORT_BASE + 17))
  DBD_PORT=$((PORT_BASE + 19))
  NODE_PORT0=$((PORT_BASE + 21))
}
listening_ports() {
  local f _a local_addr _r st _x
  for f in /proc/net/tcp /proc/net/tcp6; do
    [ -r "$f" ] || continue
    while read -r _a local_addr _r st _x; do
      if [ "$st" = 0A ]; then echo $((16#${local_addr##*:})); fi
    done < <(tail -n +2 "$f")
  done
  return 0
}
pick_ports() {  # RELAX_SLURM_PORT_BASE, or the first of 16800, 17800, ... whose ports are all free
  local base used p busy
  if [ -n "${RELAX_SLURM_PORT_BASE:-}" ]; then
    set_ports "$RELAX_SLURM_PORT_BASE"
    return
  fi
  used=" $(listening_ports | sort -u | tr '\n' ' ') "
  for ((base = 16800; base <= 25800; base += 1000)); do
    busy=
    for ((p = base + 17; p <= base + 21 + ${#NODES[@]}; p++)); do
      case $used in *" $p "*) busy=1 && break ;; esac
    done
    [ -z "$busy" ] && { set_ports "$base"; return; }
  done
  echo "slurm-cluster: no free port range in 16817..25824" >&2
  exit 1
}
KEY=$(printf '%s' "$DIR" | md5sum | cut -c1-12)
RUN=/run/relax-slurm/$KEY
MUNGE_SOCK=$RUN/munge.sock
MYSQL_SOCK=$RUN/mysqld.sock
LOG=$DIR/log

log() { echo "slurm-cluster: $*" >&2; }

# --- process helpers --------------------------------------------------------------------------
alive() {  # PID: running and not a zombie
  local st
  [ -n "${1:-}" ] && [ -r "/proc/$1/stat" ] || return 1
  st=$(sed -E 's/^.*\) (.).*$/\1/' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

pid_of() { [ -f "$RUN/$1.pid" ] && cat "$RUN/$1.pid" 2>/dev/null || true; }

wait_dead() {  # PID SECONDS
  local i
  for ((i = 0; i < $2 * 10; i++)); do alive "$1" || return 0; sleep 0.1; done
  return 1
}

ours() {  # PID: the process carries this cluster's mark (a pid file can outlive its process, and pids wrap)
  tr '\0' '\n' 2>/dev/null <"/proc/$1/environ" | grep -qxF "RELAX_SLURM_DIR=$DIR"
}

stop_daemon() {  # NAME SECONDS: SIGTERM, then SIGKILL after SECONDS
  local pid
  pid=$(pid_of "$1")
  if alive "$pid" && ours "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_dead "$pid" "$2"; then
      log "$1 (pid $pid) ignored SIGTERM for $2 s; SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      wait_dead "$pid" 5 || log "$1 (pid $pid) still alive"
    fi
  fi
  rm -f "$RUN/$1.pid"
}

start_daemon() {  # NAME COMMAND...: detached (own session), stdio to DIR/log/NAME.out
  local name=$1
  shift
  RELAX_SLURM_DIR=$DIR setsid "$@" </dev/null >>"$LOG/$name.out" 2>&1 &
  echo $! >"$RUN/$name.pid"
}

marked_pids() {  # daemons and job steps of this cluster (env RELAX_SLURM_DIR=DIR), and their jobs
  local e p env self=" $$ $PPID "
  for e in /proc/[0-9]*/environ; do
    p=${e#/proc/}
    p=${p%/environ}
    case $self in *" $p "*) continue ;; esac
    env=$(tr '\0' '\n' 2>/dev/null <"$e") || continue
    if grep -qxF "RELAX_SLURM_DIR=$DIR" <<<"$env"; then
      echo "$p"
    elif grep -qxF "SLURM_CONF=$SLURM_CONF" <<<"$env" && grep -q '^SLURM_JOB_ID=' <<<"$env"; then
      echo "$p"
    fi
  done
}

fail() {
  local f
  log "ERROR: $*"
  for f in "$LOG"/*; do
    [ -s "$f" ] || continue
    echo "----- tail $f" >&2
    tail -n 15 "$f" >&2
  done
  if [ -z "${RELAX_SLURM_KEEP_ON_FAIL:-}" ]; then cmd_stop >/dev/null 2>&1 || true; fi
  exit 1
}

poll() {  # SECONDS DESCRIPTION COMMAND...: retry COMMAND every 0.2 s until it succeeds
  local what=$2 deadline=$((SECONDS + $1))
  shift 2
  while ((SECONDS < deadline)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  fail "timed out waiting for $what"
}

# --- configuration ----------------------------------------------------------------------------
accounting_conf() {
  if [ "$ACCOUNTING" = none ]; then
    echo "AccountingStorageType=accounting_storage/none"
    return
  fi
  cat <<EOF
# accounting: slurmdbd + MariaDB (sacct, as submitit polls it)
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# the munge socket for talking to slurmdbd (default: /run/munge/munge.socket.2)
AccountingStoragePass=$MUNGE_SOCK
# GPUs in AllocTRES (sacct), which relax_hpc's accounting reads per job step
AccountingStorageTRES=gres/gpu
EOF
}

write_configs() {
  local last=$((NODE_PORT0 + ${#NODES[@]} - 1)) n i
  mkdir -p "$DIR/state" "$DIR/munge" "$DIR/dev" "$LOG" "$RUN"
  chmod 700 "$DIR/munge"
  chmod 755 /run/relax-slurm "$RUN"
  if [ ! -s "$DIR/munge/munge.key" ]; then
    head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
  fi
  chmod 400 "$DIR/munge/munge.key"
  for i in 0 1; do
    [ -c "$DIR/dev/gpu$i" ] || mknod -m 666 "$DIR/dev/gpu$i" c 1 3
  done
  for n in "${NODES[@]}"; do mkdir -p "$RUN/spool/$n"; done

  cat >"$DIR/slurm.conf" <<EOF
# Written by tools/slurm/cluster.sh: a one-host test cluster. Edits are overwritten at start.
ClusterName=$CLUSTER_NAME
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK,cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$RUN/spool/%n
SlurmctldPidFile=$RUN/slurmctld.own.pid
SlurmdPidFile=$RUN/slurmd-%n.own.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups on these machines
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
# fast turnaround for tests (cred_expire above: a requeued job may start again ~6 s later)
KillWait=5
MinJobAge=$MIN_JOB_AGE
JobRequeue=1
SchedulerParameters=bf_interval=1,sched_interval=1
# preemption: high preempts debug; the victim gets its --signal first, then GraceTime
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
$(accounting_conf)
JobCompType=jobcomp/none
GresTypes=gpu
NodeName=n[1-${#NODES[@]}] NodeHostname=localhost NodeAddr=127.0.0.1 Port=$NODE_PORT0-$last CPUs=4 RealMemory=4000 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=15
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF

  cat >"$DIR/gres.conf" <<EOF
NodeName=n[1-${#NODES[@]}] Name=gpu File=$DIR/dev/gpu[0-1]
EOF

  # slurmdbd.conf must be 0600 and owned by SlurmUser
  (
    umask 077
    cat >"$DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.own.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF
  )
  chmod 600 "$DIR/slurmdbd.conf"
}

# --- checks -----------------------------------------------------------------------------------
dbd_up() { timeout 10 sacctmgr -n -P list cluster format=cluster; }
ctld_up() { timeout 10 scontrol ping | grep -q UP; }
nodes_idle() {
  local states
  states=$(timeout 10 sinfo -h -N -p debug -o '%N %t' | sort -u)
  [ "$(grep -c ' idle$' <<<"$states")" -eq "${#NODES[@]}" ]
}
registered() {  # slurmctld has registered with slurmdbd (the cluster row has its control port)
  timeout 10 sacctmgr -n -P list cluster format=cluster,controlport | grep -qx "$CLUSTER_NAME|$CTLD_PORT"
}
sacct_ok() { timeout 10 sacct -n -X -a -S now-1minutes; }

# --- commands ---------------------------------------------------------------------------------
cmd_start() {
  local t0=$SECONDS n daemons=(munged)
  [ "$ACCOUNTING" = none ] || daemons+=(mariadb slurmdbd)
  for n in slurmctld slurmd munged sbatch $([ "$ACCOUNTING" = none ] || echo slurmdbd mariadbd mariadb-install-db sacct); do
    command -v "$n" >/dev/null || { log "$n missing: run tools/slurm/install.sh"; exit 1; }
  done
  for n in "$RUN"/*.pid; do
    if [ -f "$n" ] && alive "$(cat "$n")"; then
      log "a cluster is already running for $DIR (stop it first)"
      exit 1
    fi
  done
  pick_ports
  write_configs

  start_daemon munged munged -F --socket="$MUNGE_SOCK" --key-file="$DIR/munge/munge.key" \
    --pid-file="$RUN/munged.own.pid" --seed-file="$DIR/munge/munged.seed" \
    --log-file="$LOG/munged.log"
  poll 10 munged bash -c "munge -S '$MUNGE_SOCK' -n | unmunge -S '$MUNGE_SOCK'"
  [ "$ACCOUNTING" = none ] || start_accounting

  start_daemon slurmctld slurmctld -D -i
  poll 30 slurmctld ctld_up

  for n in "${NODES[@]}"; do
    start_daemon "slurmd-$n" slurmd -D -N "$n"
  done
  poll 60 "all nodes idle" nodes_idle
  if [ "$ACCOUNTING" != none ]; then
    poll 30 "slurmctld registered with slurmdbd" registered
    poll 30 sacct sacct_ok
  fi

  for n in "${daemons[@]}" slurmctld "${NODES[@]/#/slurmd-}"; do
    alive "$(pid_of "$n")" || fail "$n died"
  done
  sinfo >&2
  log "up in $((SECONDS - t0)) s: nodes ${NODES[*]}, partitions debug (default) and high, accounting $ACCOUNTING; logs in $LOG"
  echo "export SLURM_CONF=$DIR/slurm.conf"
}

start_accounting() {  # MariaDB, then slurmdbd
  if [ ! -d "$DIR/mysql/mysql" ]; then
    rm -rf "$DIR/mysql"
    mariadb-install-db --no-defaults --datadir="$DIR/mysql" --user=root \
      --auth-root-authentication-method=socket --skip-test-db >"$LOG/mariadb-install.log" 2>&1 ||
      fail "mariadb-install-db failed"
  fi
  start_daemon mariadb mariadbd --no-defaults --datadir="$DIR/mysql" --socket="$MYSQL_SOCK" \
    --pid-file="$RUN/mariadb.own.pid" --skip-networking --user=root \
    --log-error="$LOG/mariadb.log" --skip-log-bin --skip-name-resolve \
    --innodb-buffer-pool-size=64M --innodb-log-file-size=16M --innodb-lock-wait-timeout=900 \
    --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0
  poll 60 mariadb mariadb-admin --no-defaults --socket="$MYSQL_SOCK" -uroot ping

  MYSQL_UNIX_PORT=$MYSQL_SOCK start_daemon slurmdbd slurmdbd -D
  poll 30 slurmdbd dbd_up
}

cmd_stop() {
  local ids i p left n
  if alive "$(pid_of slurmctld)"; then
    ids=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ') || ids=
    if [ -n "${ids// /}" ]; then
      # shellcheck disable=SC2086
      scancel $ids 2>/dev/null || true
      for ((i = 0; i < 200; i++)); do
        [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break
        sleep 0.1
      done
    fi
  fi
  for n in "${NODES[@]}"; do stop_daemon "slurmd-$n" 10; done
  stop_daemon slurmctld 15
  stop_daemon slurmdbd 15
  stop_daemon mariadb 60
  stop_daemon munged 10
  # leftovers: job steps that outlived slurmd, their processes, daemons whose pid file was lost
  left=$(marked_pids)
  if [ -n "$left" ]; then
    log "killing leftover processes: $(echo $left)"
    # shellcheck disable=SC2086
    kill -KILL $left 2>/dev/null || true
    for p in $left; do wait_dead "$p" 5 || log "pid $p survived SIGKILL"; done
  fi
  rm -rf "$RUN"
  log "stopped ($DIR)"
}

cmd_status() {
  if ! alive "$(pid_of slurmctld)"; then
    echo "slurm-cluster: not running ($DIR)"
    return 3
  fi
  sinfo
}

case $CMD in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) usage ;;
esac
