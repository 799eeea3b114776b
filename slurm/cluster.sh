#!/usr/bin/env bash
# Private single-machine Slurm cluster for mpaccel's CI and contributors.
#
#   slurm/cluster.sh up [--nodes N]   start munged + slurmctld + N simulated slurmds (default 2)
#   slurm/cluster.sh down             stop everything started from the cluster directory
#   slurm/cluster.sh status           show daemons and `sinfo`; exit 0 up, 1 partly up, 3 down
#   slurm/cluster.sh env              print `export ...` lines; use: eval "$(slurm/cluster.sh env)"
#
# Everything (munge key and socket, slurm.conf, state/spool/log/pid dirs) lives under
# ${MPACCEL_SLURM_DIR:-/tmp/mpaccel-slurm}. Nothing touches /etc/slurm, /etc/munge or the system
# munged. Ports: slurmctld ${MPACCEL_SLURM_CTLD_PORT:-16817}, slurmd default
# ${MPACCEL_SLURM_SLURMD_PORT:-16818}, node i listens on ${MPACCEL_SLURM_NODE_PORT_BASE:-17000}+i.
#
# Exit code 77 means "cannot run here" (not root, no apt-get, packages not installable); callers
# turn it into a test skip. `up` is idempotent: when the cluster is already up with the same
# number of nodes it does nothing and succeeds.
#
# Slurm tools need SLURM_CONF=<dir>/etc/slurm.conf; the munge socket is found through
# AuthInfo=socket=... in that file, so no MUNGE_* variable is needed.

set -euo pipefail

DIR="${MPACCEL_SLURM_DIR:-/tmp/mpaccel-slurm}"
CTLD_PORT="${MPACCEL_SLURM_CTLD_PORT:-16817}"
SLURMD_PORT="${MPACCEL_SLURM_SLURMD_PORT:-16818}"
NODE_PORT_BASE="${MPACCEL_SLURM_NODE_PORT_BASE:-17000}"
CPUS_PER_NODE="${MPACCEL_SLURM_CPUS_PER_NODE:-4}"
UP_TIMEOUT="${MPACCEL_SLURM_UP_TIMEOUT:-30}"
PACKAGES=(slurmctld slurmd slurm-client munge)

export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:${PATH}"

CONF="$DIR/etc/slurm.conf"
MUNGE_SOCKET="$DIR/munge/munge.socket"
MUNGE_KEY="$DIR/munge-key/munge.key"
RUN="$DIR/run"
LOG="$DIR/log"
# Environment marker given to every daemon we start, so `down` never kills a process that merely
# reuses a pid from our pid files.
MARKER="MPACCEL_SLURM_CLUSTER=$DIR"

log() { printf 'cluster.sh: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }
skip() { log "$*"; exit 77; }

usage() {
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# ---------------------------------------------------------------------------------------------
# helpers

# pid of a daemon we started, if it is alive and really ours (marker in its environment)
live_pid() {
    local pidfile="$RUN/$1.pid" pid
    [[ -r "$pidfile" ]] || return 1
    pid="$(<"$pidfile")"
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [[ -r "/proc/$pid/environ" ]] || return 1
    grep -qzxF "$MARKER" "/proc/$pid/environ" 2>/dev/null || return 1
    # a zombie counts as gone
    [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]] || return 1
    echo "$pid"
}

configured_nodes() {
    [[ -r "$RUN/nodes" ]] && cat "$RUN/nodes" || echo 0
}

daemon_names() {
    local n i
    n="$(configured_nodes)"
    echo munged slurmctld
    for ((i = 1; i <= n; i++)); do echo "slurmd-n$i"; done
}

sinfo_states() {  # "n1 idle" lines, empty on failure
    SLURM_CONF="$CONF" timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true
}

# 0: all daemons alive and every node answers in sinfo; 3: nothing alive; 1: partial
cluster_state() {
    local alive=0 total=0 name states n
    [[ -r "$RUN/nodes" ]] || { echo 3; return; }
    for name in $(daemon_names); do
        total=$((total + 1))
        live_pid "$name" >/dev/null && alive=$((alive + 1))
    done
    if ((alive == 0)); then echo 3; return; fi
    if ((alive < total)); then echo 1; return; fi
    n="$(configured_nodes)"
    states="$(sinfo_states)"
    if [[ "$(grep -cE ' (idle|mixed|allocated|completing)$' <<<"$states" || true)" == "$n" ]]; then
        echo 0
    else
        echo 1
    fi
}

# ---------------------------------------------------------------------------------------------
# install

have_packages() {
    local p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || return 1
    done
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v munged >/dev/null && command -v sinfo >/dev/null
}

ensure_packages() {
    have_packages && return 0
    command -v apt-get >/dev/null || skip "Slurm/munge not installed and no apt-get to install them"
    local aptlog="${TMPDIR:-/tmp}/mpaccel-slurm-apt.log"
    log "installing ${PACKAGES[*]} with apt-get (log: $aptlog)"
    {
        DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
                "${PACKAGES[@]}"
    } >"$aptlog" 2>&1 || skip "apt-get install ${PACKAGES[*]} failed, see $aptlog"
    # The Debian packages may start system daemons through invoke-rc.d; without systemd they
    # normally do not. We never use them either way.
    have_packages || skip "packages ${PACKAGES[*]} still missing after apt-get, see $aptlog"
}

# ---------------------------------------------------------------------------------------------
# configuration

make_dirs() {
    if [[ -e "$DIR" ]]; then
        [[ -d "$DIR" && ! -L "$DIR" ]] || die "$DIR exists and is not a directory"
        [[ "$(stat -c %u "$DIR")" == "$(id -u)" ]] || die "$DIR is not owned by $(id -un)"
    fi
    mkdir -p "$DIR"
    chmod 0755 "$DIR"
    mkdir -p "$DIR/etc" "$DIR/munge" "$DIR/munge-key" "$DIR/state" "$DIR/spool" "$RUN" "$LOG"
    chmod 0755 "$DIR/munge"       # socket directory: clients of any user may connect
    chmod 0700 "$DIR/munge-key" "$DIR/state"
    if [[ ! -s "$MUNGE_KEY" ]]; then
        (umask 077 && dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none)
    fi
    chmod 0400 "$MUNGE_KEY"
}

write_conf() {
    local nodes="$1" host last_port tmp
    host="$(hostname -s 2>/dev/null || true)"
    [[ -n "$host" ]] || host="$(uname -n)"
    host="${host%%.*}"
    last_port=$((NODE_PORT_BASE + nodes))
    local names ports
    if ((nodes == 1)); then
        names="n1"; ports="$((NODE_PORT_BASE + 1))"
    else
        names="n[1-$nodes]"; ports="[$((NODE_PORT_BASE + 1))-$last_port]"
    fi
    tmp="$CONF.tmp.$$"
    cat >"$tmp" <<EOF
# Generated by mpaccel slurm/cluster.sh -- private single-machine test cluster. Do not edit.
ClusterName=mpaccel
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=20
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$RUN/slurmctld.daemon.pid
SlurmdPidFile=$RUN/slurmd-%n.daemon.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=60
SlurmdTimeout=300
MailProg=/bin/true
NodeName=$names NodeHostname=$host NodeAddr=127.0.0.1 Port=$ports CPUs=$CPUS_PER_NODE State=UNKNOWN
PartitionName=debug Nodes=$names Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    mv -f "$tmp" "$CONF"
    echo "$nodes" >"$RUN/nodes"
}

# ---------------------------------------------------------------------------------------------
# start / stop

# start NAME LOGFILE CMD...: setsid'd background daemon, our own pid file, marker in its env
start_daemon() {
    local name="$1" out="$2"
    shift 2
    env "$MARKER" SLURM_CONF="$CONF" setsid "$@" </dev/null >>"$out" 2>&1 &
    local pid=$! t
    echo "$pid" >"$RUN/$name.pid"
    # wait for the exec (the marker shows in /proc/PID/environ only after it)
    for ((t = 0; t < 50; t++)); do
        live_pid "$name" >/dev/null && return 0
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    show_logs
    die "$name did not start: $*"
}

show_logs() {
    local f
    for f in "$LOG"/*; do
        [[ -f "$f" ]] || continue
        printf '\n===== %s (last 25 lines) =====\n' "$f" >&2
        tail -n 25 "$f" >&2 || true
    done
}

cmd_up() {
    local nodes=2
    while (($#)); do
        case "$1" in
            --nodes) [[ $# -ge 2 ]] || usage; nodes="$2"; shift 2 ;;
            --nodes=*) nodes="${1#--nodes=}"; shift ;;
            *) usage ;;
        esac
    done
    [[ "$nodes" =~ ^[0-9]+$ ]] && ((nodes >= 1 && nodes <= 64)) || die "--nodes must be 1..64"

    [[ "$(id -u)" == 0 ]] || skip "needs root (Slurm daemons run as SlurmUser=root)"
    ensure_packages

    local state
    state="$(cluster_state)"
    if [[ "$state" == 0 ]]; then
        if [[ "$(configured_nodes)" == "$nodes" ]]; then
            log "already up ($nodes nodes) in $DIR"
            return 0
        fi
        log "up with $(configured_nodes) nodes, restarting with $nodes"
        cmd_down
    elif [[ "$state" == 1 ]]; then
        log "partly up or unhealthy, restarting"
        cmd_down
    fi

    make_dirs
    write_conf "$nodes"
    rm -f "$LOG"/*.log "$LOG"/*.out "$RUN"/*.daemon.pid
    rm -rf "${DIR:?}/spool/"*

    start_daemon munged "$LOG/munged.out" \
        munged --foreground --force --socket="$MUNGE_SOCKET" --key-file="$MUNGE_KEY" \
        --pid-file="$RUN/munged.daemon.pid" --log-file="$LOG/munged.log" \
        --seed-file="$DIR/munge-key/munged.seed"
    local t0=$SECONDS
    until [[ -S "$MUNGE_SOCKET" ]]; do
        if ! live_pid munged >/dev/null || ((SECONDS - t0 > 10)); then
            show_logs; cmd_down >/dev/null 2>&1 || true; die "munged did not start"
        fi
        sleep 0.1
    done

    start_daemon slurmctld "$LOG/slurmctld.out" slurmctld -D -i -f "$CONF"
    local i
    for ((i = 1; i <= nodes; i++)); do
        start_daemon "slurmd-n$i" "$LOG/slurmd-n$i.out" slurmd -D -N "n$i" -f "$CONF"
    done

    t0=$SECONDS
    local states
    while :; do
        states="$(sinfo_states)"
        if [[ "$(grep -c ' idle$' <<<"$states" || true)" == "$nodes" ]]; then
            break
        fi
        local name
        for name in $(daemon_names); do
            if ! live_pid "$name" >/dev/null; then
                show_logs; cmd_down >/dev/null 2>&1 || true; die "$name exited during start-up"
            fi
        done
        if ((SECONDS - t0 >= UP_TIMEOUT)); then
            printf 'sinfo:\n%s\n' "$states" >&2
            show_logs; cmd_down >/dev/null 2>&1 || true
            die "nodes not idle after ${UP_TIMEOUT}s"
        fi
        sleep 0.2
    done
    log "up: $nodes nodes idle in $DIR; use: eval \"\$($0 env)\""
}

# SIGTERM, wait up to $2 s, then SIGKILL
stop_pid() {
    local pid="$1" wait="${2:-10}" t
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((t = 0; t < wait * 10; t++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" == Z ]] && return 0
        sleep 0.1
    done
    log "pid $pid ignored SIGTERM for ${wait}s, sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((t = 0; t < 50; t++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
}

# slurmstepd processes (and their process trees) of this cluster left behind by a killed slurmd
leftover_stepds() {
    local p
    for p in /proc/[0-9]*; do
        [[ "$(cat "$p/comm" 2>/dev/null)" == slurmstepd ]] || continue
        # slurmstepd overwrites its environment (process title), but keeps the slurmd log open
        local fd
        for fd in "$p"/fd/*; do
            if [[ "$(readlink "$fd" 2>/dev/null)" == "$LOG"/* ]]; then
                echo "${p#/proc/}"
                break
            fi
        done
    done
    return 0
}

cmd_down() {
    local name pid stopped=0
    # Cancel jobs first so slurmd cleans up steps and tasks itself.
    if live_pid slurmctld >/dev/null; then
        local jobs
        jobs="$(SLURM_CONF="$CONF" timeout 10 squeue -h -o %A 2>/dev/null || true)"
        if [[ -n "$jobs" ]]; then
            # shellcheck disable=SC2086
            SLURM_CONF="$CONF" timeout 10 scancel $jobs 2>/dev/null || true
            local t
            for ((t = 0; t < 100; t++)); do
                [[ -z "$(SLURM_CONF="$CONF" timeout 5 squeue -h -t all -o '%A %T' 2>/dev/null |
                    grep -vE ' (CANCELLED|COMPLETED|FAILED|TIMEOUT|PREEMPTED|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE)$' || true)" ]] && break
                sleep 0.1
            done
        fi
    fi
    # slurmds, then slurmctld, then munged
    local names=()
    for pid in "$RUN"/slurmd-n*.pid; do
        [[ -e "$pid" ]] || continue
        pid="${pid##*/}"; names+=("${pid%.pid}")
    done
    names+=(slurmctld munged)
    for name in "${names[@]}"; do
        [[ "$name" == *.daemon ]] && continue
        if pid="$(live_pid "$name")"; then
            stop_pid "$pid" 10
            stopped=$((stopped + 1))
        fi
        rm -f "$RUN/$name.pid"
    done
    local stepds
    stepds="$(leftover_stepds)"
    if [[ -n "$stepds" ]]; then
        # slurmstepd and every process below it (the job's tasks), found through parent pids
        local victims
        victims="$(ps -eo pid=,ppid= | awk -v roots="$stepds" '
            BEGIN { n = split(roots, r, /[ \n]+/); for (i = 1; i <= n; i++) if (r[i] != "") keep[r[i]] = 1 }
            { parent[$1] = $2 }
            END { do { changed = 0
                       for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; changed = 1 }
                  } while (changed)
                  for (p in keep) print p }')"
        log "killing leftover slurmstepd processes and their tasks: $(echo $victims)"
        # shellcheck disable=SC2086
        kill -KILL $victims 2>/dev/null || true
    fi
    rm -f "$RUN"/*.daemon.pid "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
    if ((stopped)); then log "down: stopped $stopped daemons from $DIR"; else log "down: nothing running in $DIR"; fi
}

cmd_status() {
    local name pid state
    echo "cluster dir: $DIR"
    [[ -r "$RUN/nodes" ]] || { echo "not configured"; return 3; }
    for name in $(daemon_names); do
        if pid="$(live_pid "$name")"; then echo "  $name: running (pid $pid)"; else echo "  $name: stopped"; fi
    done
    state="$(cluster_state)"
    if [[ "$state" != 3 ]]; then
        SLURM_CONF="$CONF" timeout 10 sinfo -N -o '%N %P %T %c %O' 2>&1 | sed 's/^/  /' || true
    fi
    case "$state" in
        0) echo "status: up" ;;
        1) echo "status: partly up / unhealthy" ;;
        3) echo "status: down" ;;
    esac
    return "$state"
}

cmd_env() {
    printf 'export SLURM_CONF=%q\n' "$CONF"
    printf 'export MPACCEL_SLURM_DIR=%q\n' "$DIR"
}

case "${1:-}" in
    up) shift; cmd_up "$@" ;;
    down) shift; (($# == 0)) || usage; cmd_down ;;
    status) shift; (($# == 0)) || usage; cmd_status ;;
    env) shift; (($# == 0)) || usage; cmd_env ;;
    *) usage ;;
esac
