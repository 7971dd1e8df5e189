#!/usr/bin/env bash
# Two "hosts" on one machine for trying a multi-host layout before renting a cluster: two network
# namespaces with their own hostnames (hosta, hostb), joined by a veth pair (10.77.0.1 and
# 10.77.0.2, nothing routed anywhere else). mpirun runs on hosta and starts its daemon on hostb
# through an rsh agent that does `ip netns exec` where a cluster would do ssh; MPI traffic is
# pinned to the pair (TCP only). Each host's processes get their own /tmp and /dev/shm (a mount
# namespace with fresh tmpfs mounts), so no shared-memory page or session file crosses hosts; every
# other directory is shared, as a cluster's file system would share the run and checkpoint ones.
# A host's /dev/shm is its memory: one tmpfs per host for as long as the hosts are up, the same for
# every process started on it (a job restarted on a host finds what the previous one left there),
# emptied when the host is lost (`kill`).
#
#   scripts/twohost.sh run -n 4 -- build/tetra train --config configs/tiny.toml ...
#       creates the hosts, runs the command as `mpirun -np N` with ranks dealt over both hosts
#       (N/2 each: ranks 0..N/2-1 on hosta), and removes the hosts afterwards, whatever happens
#   scripts/twohost.sh on-hosta -- COMMAND
#       the same for a command that starts mpirun itself (tetra launch --hosts 10.77.0.1:2,...):
#       it runs on hosta with the MPI settings of the hosts in its environment
#   scripts/twohost.sh slurm -- srun -N2 -n4 build/tetra train ...   (or sbatch --wait job.sbatch)
#       the same with a two-node Slurm cluster on the hosts (munge, slurmctld, one slurmd per
#       host; Slurm's PMIx plugin, KillOnBadExit=1), SLURM_CONF set for the command
#   scripts/twohost.sh kill hostb  (beside a run of the same TWOHOST_ID) kills every process on
#       hostb, the MPI daemon included, and empties its memory (/dev/shm): a host lost (and back
#       at once, as after a quick reboot); with --down it stays unreachable (the rsh agent, as ssh
#       would, fails to reach it) until `scripts/twohost.sh revive hostb`
#   scripts/twohost.sh cut         (beside a run) sets the pair down: a network partition
#   scripts/twohost.sh check       exits 0 when this machine lets it create namespaces
#   scripts/twohost.sh up | down   creates or removes the hosts by hand
#
# Needs root (ip netns). TWOHOST_ID (default: this script's pid) names the namespaces, so runs
# side by side do not meet; the addresses live inside the namespaces only.
set -euo pipefail

ID=${TWOHOST_ID:-$$}
NS_A=tetra-$ID-a
NS_B=tetra-$ID-b
VETH_A=tva$ID
VETH_B=tvb$ID
IP_A=10.77.0.1
IP_B=10.77.0.2
NET=10.77.0.0/24
# Each host's memory (its /dev/shm): a tmpfs mounted here while the hosts are up.
MEM=/run/tetra-twohost-$ID

up() {
  ip netns add "$NS_A"
  ip netns add "$NS_B"
  ip link add "$VETH_A" type veth peer name "$VETH_B"
  ip link set "$VETH_A" netns "$NS_A"
  ip link set "$VETH_B" netns "$NS_B"
  ip -n "$NS_A" addr add "$IP_A/24" dev "$VETH_A"
  ip -n "$NS_B" addr add "$IP_B/24" dev "$VETH_B"
  for ns in "$NS_A" "$NS_B"; do
    ip -n "$ns" link set lo up
  done
  ip -n "$NS_A" link set "$VETH_A" up
  ip -n "$NS_B" link set "$VETH_B" up
  for h in hosta hostb; do
    mkdir -p "$MEM/$h"
    mount -t tmpfs -o size=50% tmpfs "$MEM/$h"
  done
}

check() {
  local ns=tetra-$ID-check
  if ! ip netns add "$ns" 2>/dev/null; then
    echo "twohost.sh: cannot create a network namespace here (needs root and CAP_SYS_ADMIN)" >&2
    return 1
  fi
  ip netns del "$ns"
}

down() {
  # Every process left in a namespace first (a daemon on hostb outlives a failed job otherwise).
  for ns in "$NS_A" "$NS_B"; do
    if ip netns list | grep -qw "$ns"; then
      ip netns pids "$ns" | xargs -r kill -9 2>/dev/null || true
      ip netns del "$ns"
    fi
  done
  for h in hosta hostb; do
    mountpoint -q "$MEM/$h" && umount -l "$MEM/$h"
  done
  rm -rf "$MEM"
}

# A shell command line that runs the rest of the line as host NAME: its hostname, its own /tmp and
# its memory as /dev/shm (inside `ip netns exec NS unshare --uts --mount`).
as_host() {
  echo "hostname $1 && mount -t tmpfs tmpfs /tmp && mount --bind $MEM/$1 /dev/shm &&"
}

# The rsh agent: "AGENT [ssh options] HOST COMMAND..." runs COMMAND (a shell command line, as ssh
# gives it to the remote shell) on HOST's namespace as that host.
agent() {
  local dir=$1
  cat >"$dir/rsh" <<EOF
#!/usr/bin/env bash
while [[ \$1 == -* ]]; do shift; done
host=\$1; shift
case \$host in
  $IP_A|hosta) ns=$NS_A name=hosta ;;
  $IP_B|hostb) ns=$NS_B name=hostb ;;
  *) echo "twohost rsh: unknown host \$host" >&2; exit 255 ;;
esac
if [ -e $MEM/\$name.down ]; then
  echo "ssh: connect to host \$host port 22: No route to host" >&2
  exit 255
fi
exec ip netns exec \$ns unshare --uts --mount sh -c "$(as_host '$name') \$*"
EOF
  chmod +x "$dir/rsh"
}

# The hosts' MPI settings, as environment (mpirun passes OMPI_MCA_* on to its daemons): the rsh
# agent, and TCP on the pair only.
mpi_env() {
  echo "OMPI_MCA_plm_rsh_agent=$AGENT_DIR/rsh OMPI_MCA_btl=tcp,self" \
    "OMPI_MCA_btl_tcp_if_include=$NET OMPI_MCA_oob_tcp_if_include=$NET"
}

# Creates the hosts (with SLURM=1, a Slurm cluster on them) and runs a shell command line on
# hosta with mpi_env (and SLURM_CONF) set, then removes them.
on_hosta() {
  # Not under /tmp: the hosts' own /tmp hides it from mpirun.
  AGENT_DIR=$(mktemp -d /run/tetra-twohost.XXXXXX)
  trap 'slurm_down; down; rm -rf "$AGENT_DIR"' EXIT
  down
  up
  agent "$AGENT_DIR"
  local env
  env=$(mpi_env)
  if [[ ${SLURM:-} == 1 ]]; then
    slurm_up
    env+=" SLURM_CONF=$AGENT_DIR/slurm.conf"
  fi
  ip netns exec "$NS_A" unshare --uts --mount sh -c "$(as_host hosta) export $env && $1"
}

# A two-node Slurm cluster on the hosts, in $AGENT_DIR: munged (in this namespace; its socket is a
# file every namespace reaches), slurmctld on hosta, one slurmd per host. slurmd is entered with
# nsenter --net (ip netns exec remounts /sys, which hides the cgroup tree slurmd needs), and each
# node has its own TmpFS (PMIx makes per-step directories there; two nodes sharing one collide).
slurm_up() {
  local d=$AGENT_DIR n i
  mkdir -p "$d/state" "$d/tmp-hosta" "$d/tmp-hostb"
  mungekey --create --keyfile="$d/munge.key"
  munged -f --socket="$d/munge.sock" --key-file="$d/munge.key" --pid-file="$d/munged.pid" \
    --log-file="$d/munged.log" --seed-file="$d/munged.seed"
  for n in hosta hostb; do
    cat >"$d/slurm-$n.conf" <<EOF
ClusterName=tetra
SlurmctldHost=hosta($IP_A)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$d/munge.sock
CredType=cred/munge
MpiDefault=pmix
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmctldPort=26817
SlurmdPort=26818
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool-%n
SlurmctldPidFile=$d/slurmctld.pid
SlurmdPidFile=$d/slurmd-%n.pid
SlurmctldLogFile=$d/slurmctld.log
SlurmdLogFile=$d/slurmd-%n.log
SchedulerType=sched/builtin
SelectType=select/linear
ReturnToService=2
# Finished jobs' records purged after 4 s (at least 2) instead of 300: sbatch --wait polls every
# 2 s while that is at least half of MinJobAge, 8 and then 32 s apart otherwise.
MinJobAge=4
KillOnBadExit=1
MailProg=/bin/true
DebugFlags=NO_CONF_HASH
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
TmpFS=$d/tmp-$n
NodeName=hosta NodeAddr=$IP_A CPUs=$(nproc) State=UNKNOWN
NodeName=hostb NodeAddr=$IP_B CPUs=$(nproc) State=UNKNOWN
PartitionName=main Nodes=hosta,hostb Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
  done
  cp "$d/slurm-hosta.conf" "$d/slurm.conf"
  nsenter --net=/run/netns/"$NS_A" unshare --uts \
    sh -c "hostname hosta && exec slurmctld -f $d/slurm.conf"
  nsenter --net=/run/netns/"$NS_A" unshare --uts --mount \
    sh -c "$(as_host hosta) exec slurmd -f $d/slurm-hosta.conf -N hosta"
  nsenter --net=/run/netns/"$NS_B" unshare --uts --mount \
    sh -c "$(as_host hostb) exec slurmd -f $d/slurm-hostb.conf -N hostb"
  for i in $(seq 100); do
    [[ $(SLURM_CONF=$d/slurm.conf nsenter --net=/run/netns/"$NS_A" sinfo -h -o %T 2>/dev/null |
      sort -u) == idle ]] && return 0
    sleep 0.1
  done
  echo "twohost.sh slurm: the nodes did not come up; their logs:" >&2
  cat "$d"/slurm*.log >&2
  return 1
}

slurm_down() {
  local f pids=() i
  for f in "$AGENT_DIR"/slurmctld.pid "$AGENT_DIR"/slurmd-*.pid "$AGENT_DIR"/munged.pid; do
    [[ -f $f ]] && pids+=("$(cat "$f")")
  done
  [[ ${#pids[@]} -gt 0 ]] || return 0
  kill "${pids[@]}" 2>/dev/null || true
  # Gone before their directory is removed (they write their state on the way out).
  for i in $(seq 50); do
    kill -0 "${pids[@]}" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -9 "${pids[@]}" 2>/dev/null || true
}

command_after_dashes() {
  [[ ${1:-} == -- ]] && shift
  [[ $# -gt 0 ]] || { echo "twohost.sh: give the command after --" >&2; exit 2; }
  printf '%q ' "$@"
}

run() {
  local n=2
  while [[ $# -gt 0 && $1 != -- ]]; do
    case $1 in
      -n) n=$2; shift 2 ;;
      *) echo "twohost.sh run: unknown option $1 (use -n N -- COMMAND)" >&2; exit 2 ;;
    esac
  done
  local cmd
  cmd=$(command_after_dashes "$@")
  (( n % 2 == 0 )) || { echo "twohost.sh run: -n must be even (N/2 ranks per host)" >&2; exit 2; }
  local per=$((n / 2)) env=(-x PATH -x HOME)
  [[ -n ${TETRA_MATMUL:-} ]] && env+=(-x TETRA_MATMUL)
  on_hosta "exec mpirun --allow-run-as-root --oversubscribe --bind-to none -np $n \
    --host $IP_A:$per,$IP_B:$per --wdir $(printf '%q' "$PWD") ${env[*]} $cmd"
}

case ${1:-} in
  check) check ;;
  up) up ;;
  down) down ;;
  run) shift; run "$@" ;;
  kill)
    case ${2:-} in
      hosta) ns=$NS_A ;;
      hostb) ns=$NS_B ;;
      *) echo "twohost.sh kill: name the host, hosta or hostb" >&2; exit 2 ;;
    esac
    [[ ${3:-} == --down ]] && touch "$MEM/$2.down"
    ip netns pids "$ns" | xargs -r kill -9
    # Its memory is gone with it.
    find "$MEM/$2" -mindepth 1 -delete ;;
  revive)
    case ${2:-} in
      hosta|hostb) rm -f "$MEM/$2.down" ;;
      *) echo "twohost.sh revive: name the host, hosta or hostb" >&2; exit 2 ;;
    esac ;;
  cut) ip -n "$NS_A" link set "$VETH_A" down ;;
  on-hosta) shift; on_hosta "cd $(printf '%q' "$PWD") && exec $(command_after_dashes "$@")" ;;
  slurm) shift; SLURM=1 on_hosta "cd $(printf '%q' "$PWD") && exec $(command_after_dashes "$@")" ;;
  *) echo "usage: scripts/twohost.sh run [-n N] -- COMMAND | on-hosta -- COMMAND |" \
       "slurm -- COMMAND | kill hostb [--down] | revive hostb | cut | check | up | down" >&2; exit 2 ;;
esac
