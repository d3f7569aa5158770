#!/usr/bin/env bash
# A Slurm cluster of N hosts on this machine, for the tests across hosts: each host is a
# network namespace (its own address on a bridge), a UTS namespace (its own host name) and a
# mount namespace (its own /tmp and /etc/hosts), with one slurmd; slurmctld and munged run on
# the bridge's address. Debian's slurmctld, slurmd, slurm-client and munge; root.
#
#   scripts/cluster.sh up DIR [N]   start hosts h1..hN (default 2); prints `export ...` lines
#   scripts/cluster.sh run I CMD... run CMD on host hI (its network, name, /tmp)
#   scripts/cluster.sh kill I PAT   SIGKILL host hI's processes whose command line matches PAT
#   scripts/cluster.sh down         stop everything and remove the namespaces
#
# Addresses: bridge accelbr0 10.77.0.1/24 (the controller, "ctl"), host hI at 10.77.0.(10+I).
set -euo pipefail

BRIDGE=accelbr0
NET=10.77.0
PREFIX=accel-h
ROOT=$(cd "$(dirname "$0")/.." && pwd)

die() { echo "cluster.sh: $*" >&2; exit 1; }

pid_of_host() { cat "/run/$PREFIX$1.pid" 2>/dev/null || die "host h$1 is not up"; }

# Runs a command inside host I's namespaces (network from `ip netns`, the rest from the
# host's anchor process, which also holds its name, /tmp and /etc/hosts).
run_on() {
    local i=$1; shift
    local pid; pid=$(pid_of_host "$i")
    exec nsenter --target "$pid" --uts --mount --net -- "$@"
}

# Kills (SIGKILL) the processes of host I whose command line matches PATTERN: the host's
# processes are those in its UTS namespace (process ids are shared with this machine).
kill_on() {
    local i=$1 pattern=$2
    local ns; ns=$(readlink "/proc/$(pid_of_host "$i")/ns/uts")
    local n=0
    for p in $(pgrep -f "$pattern" || true); do
        [ "$(readlink "/proc/$p/ns/uts" 2>/dev/null)" = "$ns" ] || continue
        [ "$p" = "$(pid_of_host "$i")" ] && continue
        kill -9 "$p" 2>/dev/null && n=$((n + 1))
    done
    echo "killed $n processes on h$i"
}

# What `up` started, for `down`: the cluster's folder (whose pid files name slurmctld) and,
# when `up` had to start munged, munged's pid.
STATE=/run/accel-cluster.dir
MUNGED_PID=/run/accel-cluster.munged

# Ends only what `up` started, by process id: slurmctld (its pid file), every process of each
# host (slurmd, slurmstepd and the jobs: the processes in the host's UTS namespace, then the
# host's anchor), munged if `up` started it; then the namespaces, links and /etc/hosts lines
# it made. A slurmd or slurmctld of the machine itself (a Slurm compute node) is left alone.
down() {
    local dir pids=""
    dir=$(cat "$STATE" 2>/dev/null || true)
    if [ -n "$dir" ] && [ -f "$dir/slurmctld.pid" ]; then
        local ctld; ctld=$(cat "$dir/slurmctld.pid" 2>/dev/null || true)
        # Only if it is the slurmctld of this cluster's configuration.
        if [ -n "$ctld" ] && tr '\0' ' ' < "/proc/$ctld/cmdline" 2>/dev/null | grep -q -- "-f $dir/slurm.conf"; then
            kill "$ctld" 2>/dev/null && pids="$pids $ctld"
        fi
    fi
    for pidfile in /run/$PREFIX*.pid; do
        [ -e "$pidfile" ] || continue
        local anchor; anchor=$(cat "$pidfile")
        local ns; ns=$(readlink "/proc/$anchor/ns/uts" 2>/dev/null || true)
        if [ -n "$ns" ] && [ "$ns" != "$(readlink /proc/$$/ns/uts)" ]; then
            for p in $(ls /proc | grep -E '^[0-9]+$'); do
                [ "$p" = "$anchor" ] && continue
                [ "$(readlink "/proc/$p/ns/uts" 2>/dev/null)" = "$ns" ] || continue
                kill -9 "$p" 2>/dev/null && pids="$pids $p"
            done
            kill -9 "$anchor" 2>/dev/null && pids="$pids $anchor"
        fi
        rm -f "$pidfile"
    done
    if [ -f "$MUNGED_PID" ]; then
        local munged; munged=$(cat "$MUNGED_PID")
        kill "$munged" 2>/dev/null && pids="$pids $munged"
        rm -f "$MUNGED_PID"
    fi
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$PREFIX" || true); do
        ip netns del "$ns" 2>/dev/null || true
    done
    # A namespace's end frees its veth pair asynchronously: remove them here.
    for link in $(ip -o link 2>/dev/null | grep -o 'veth-h[0-9]*' | sort -u); do
        ip link del "$link" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -rf /etc/netns/$PREFIX* 2>/dev/null || true
    sed -i "/^$NET\./d" /etc/hosts 2>/dev/null || true
    rm -f "$STATE"
    # Daemons take a moment to let go of their ports.
    for _ in $(seq 1 50); do
        local alive=0
        for p in $pids; do [ -d "/proc/$p" ] && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
}

up() {
    local dir=$1 n=${2:-2}
    [ "$(id -u)" = 0 ] || die "needs root (namespaces, slurmd)"
    for tool in slurmctld slurmd srun munged unshare nsenter ip; do
        command -v "$tool" >/dev/null || die "$tool is not installed (apt-get install slurmctld slurmd slurm-client munge iproute2)"
    done
    down >/dev/null 2>&1 || true
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    echo "$dir" > "$STATE"
    # A failed start leaves nothing running.
    trap 'status=$?; if [ "$status" != 0 ]; then down >/dev/null 2>&1; fi' EXIT
    # Each host gets a /tmp of its own; what the cluster needs that lies under the machine's
    # /tmp (a checkout there, the cluster's folder) is bound back in at its own path.
    local keep=""
    case "$ROOT/" in /tmp/*) keep="$ROOT" ;; esac
    case "$dir/" in "$ROOT"/*) ;; /tmp/*) keep="$keep $dir" ;; esac

    ip link add "$BRIDGE" type bridge || die "the kernel refused a bridge (no CAP_NET_ADMIN?)"
    ip addr add "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local hosts="127.0.0.1 localhost
$NET.1 ctl"
    for i in $(seq 1 "$n"); do hosts="$hosts
$NET.$((10 + i)) h$i"; done
    for i in $(seq 1 "$n"); do
        local ns=$PREFIX$i
        ip netns add "$ns"
        ip link add "veth-h$i" type veth peer name eth0 netns "$ns"
        ip link set "veth-h$i" master "$BRIDGE" up
        ip -n "$ns" addr add "$NET.$((10 + i))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" route add default via "$NET.1"
        mkdir -p "/etc/netns/$ns" "$dir/h$i/tmp"
        echo "$hosts" > "/etc/netns/$ns/hosts"
        echo "h$i" > "/etc/netns/$ns/hostname"
        # The anchor: a process that holds the host's name and mounts; everything of the host
        # enters its namespaces.
        # (nsenter, not `ip netns exec`, which would mount a fresh /sys without cgroups.)
        local rebind=""
        for path in $keep; do
            rebind="$rebind mkdir -p '$dir/h$i/tmp/${path#/tmp/}' && mount --bind '$path' '$dir/h$i/tmp/${path#/tmp/}' &&"
        done
        nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private sh -c "
            hostname h$i
            mount --bind /etc/netns/$ns/hosts /etc/hosts
            $rebind mount --rbind '$dir/h$i/tmp' /tmp
            exec sleep infinity" </dev/null >/dev/null 2>&1 &
        echo $! > "/run/$ns.pid"
    done
    # The root namespace resolves the hosts too (srun and the controller name them).
    for i in $(seq 1 "$n"); do echo "$NET.$((10 + i)) h$i" >> /etc/hosts; done
    echo "$NET.1 ctl" >> /etc/hosts

    rm -rf "$dir/state" "$dir/log" "$dir"/spool-h*
    mkdir -p "$dir/state" "$dir/log"
    for i in $(seq 1 "$n"); do mkdir -p "$dir/spool-h$i"; done
    cat > "$dir/slurm.conf" <<EOF
ClusterName=accel
SlurmctldHost=$(hostname -s)($NET.1)
MailProg=/bin/true
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=30
$(for i in $(seq 1 "$n"); do echo "NodeName=h$i NodeAddr=$NET.$((10 + i)) CPUs=$(nproc) RealMemory=2000 State=UNKNOWN"; done)
PartitionName=debug Nodes=h[1-$n] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF

    # munged, unless one already answers (Debian's postinst may have started it).
    if [ ! -f /etc/munge/munge.key ]; then
        mungekey --create 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
        chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    fi
    if ! munge -n </dev/null >/dev/null 2>&1; then
        mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
        su -s /bin/sh munge -c munged 2>/dev/null || munged --force
        for _ in $(seq 1 50); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.1; done
        munge -n </dev/null >/dev/null 2>&1 || die "munged did not start (/var/log/munge/munged.log)"
        # Ours to end at `down`: munged's pid file, where Debian's build puts it.
        cat /run/munge/munged.pid > "$MUNGED_PID" 2>/dev/null || true
    fi
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$dir/slurm.conf" -i
    for i in $(seq 1 "$n"); do
        (run_on "$i" slurmd -f "$dir/slurm.conf" -N "h$i") || die "slurmd on h$i did not start: $dir/log/slurmd-h$i.log"
    done
    # Ready when every node is idle.
    for _ in $(seq 1 100); do
        if [ "$(sinfo -h -o '%t' -N 2>/dev/null | grep -c idle || true)" -ge "$n" ]; then
            echo "export SLURM_CONF=$dir/slurm.conf"
            return 0
        fi
        sleep 0.2
    done
    sinfo -N >&2 || true
    die "the nodes did not come up: $dir/log/"
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down) down ;;
    run) shift; run_on "$@" ;;
    kill) shift; kill_on "$@" ;;
    *) die "usage: $0 up DIR [N] | run I CMD... | kill I PATTERN | down" ;;
esac
