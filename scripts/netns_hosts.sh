#!/usr/bin/env bash
# Test hosts on a real link: N network namespaces ("hosts"), each with one interface eth0 joined
# by a bridge in a switch namespace, every host's egress shaped by tc netem (rate and one-way
# delay). Runs COMMAND once in every host, all at once, with HOST_INDEX (0..N-1), HOST_COUNT,
# HOST_ADDR (this host's address), MASTER_ADDR (host 0's), LINK_RATE_BITS and LINK_DELAY_APPLIED
# in its environment; waits for all,
# and removes everything it made whatever happens. Needs root (sessions and CI have it) and
# iproute2.
#
#   scripts/netns_hosts.sh [--hosts 2] [--rate 10gbit] [--delay 50us] [--name uly] -- COMMAND...
#   scripts/netns_hosts.sh --check    # exit 0 when namespaces can be made here, else say why
#
# Exit status: the first failing host's, else 0. Each output line is prefixed "[host K] ".
set -euo pipefail

hosts=2 rate=10gbit delay=50us name=uly check_only=0
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while (($#)); do
  case "$1" in
    --hosts) hosts=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --delay) delay=$2; shift 2 ;;
    --name) name=$2; shift 2 ;;
    --check) check_only=1; shift ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "netns_hosts: unknown option '$1'" >&2; usage ;;
  esac
done
[[ "$hosts" =~ ^[0-9]+$ ]] && ((hosts >= 1 && hosts <= 200)) ||
  { echo "netns_hosts: --hosts must be 1..200; got '$hosts'" >&2; exit 2; }
[[ "$name" =~ ^[a-z][a-z0-9]{0,5}$ ]] ||
  { echo "netns_hosts: --name must be 1-6 lower-case letters or digits; got '$name'" >&2; exit 2; }
((check_only || $#)) || { echo "netns_hosts: no command given (after --)" >&2; usage; }

# The link: every packet leaving a host waits `delay` and leaves at `rate` (netem). Kernels
# without sch_netem (some container hosts) still have tbf: the rate is shaped, the delay is not
# added, and LINK_DELAY_APPLIED=0 tells the command so.
rate_bits() {  # 10gbit -> 10000000000
  local n=${1%%[a-z]*} unit=${1##*[0-9.]}
  case "$unit" in
    bit) echo "$n" ;; kbit) echo "$((n * 1000))" ;; mbit) echo "$((n * 1000000))" ;;
    gbit) echo "$((n * 1000000000))" ;;
    *) echo "netns_hosts: --rate must be an integer with bit, kbit, mbit or gbit; got '$1'" >&2; exit 2 ;;
  esac
}
bits=$(rate_bits "$rate")
[[ "$bits" =~ ^[0-9]+$ ]] && ((bits > 0)) || exit 2
delay_applied=1 delay_said=$delay
shape() {
  local ns=$1 burst=$((bits / 8 / 1000))  # one millisecond of the rate, at least 64 KiB
  ((burst >= 65536)) || burst=65536
  if ((delay_applied)) && ip netns exec "$ns" tc qdisc add dev eth0 root netem delay "$delay" \
      rate "$rate" limit 100000 2>/dev/null; then
    return
  fi
  if ((delay_applied)); then
    delay_applied=0 delay_said="0 (this kernel has no netem qdisc: the rate is shaped by tbf, no delay is added)"
  fi
  # A queue of 2 ms, as a NIC's ring holds: with tbf's usual 50 ms, a host that sends and
  # receives at once (every all-to-all) queues its ACKs behind 50 ms of its own data, and TCP
  # then reaches about half the rate each way.
  ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 2ms
}

subnet=10.213.0
cpus=$(nproc)
((cpus <= 32)) || cpus=32
rps_cpus=$(printf '%x' $(((1 << cpus) - 1)))  # The first (up to) 32 CPUs.
steer() {  # steer NAMESPACE DEVICE: RPS over those CPUs (a kernel without RPS keeps its default)
  ip netns exec "$1" sh -c "echo $rps_cpus > /sys/class/net/$2/queues/rx-0/rps_cpus" 2>/dev/null ||
    true
}
switch="${name}sw"
made=()
cleanup() {
  local ns
  for ns in "${made[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Namespaces need root and a kernel that allows them (a container may not).
probe="${name}probe$$"
if ! err=$(ip netns add "$probe" 2>&1); then
  echo "netns_hosts: cannot create network namespaces here: $err" >&2
  exit 3
fi
ip netns del "$probe"
((check_only)) && { echo "netns_hosts: network namespaces can be created here"; exit 0; }

ip netns add "$switch"
made+=("$switch")
ip -n "$switch" link add br0 type bridge
ip -n "$switch" link set br0 up
for ((h = 0; h < hosts; h++)); do
  ns="${name}h$h"
  ip netns add "$ns"
  made+=("$ns")
  ip link add "${name}e$h" netns "$ns" type veth peer name "p$h" netns "$switch"
  ip -n "$ns" link set "${name}e$h" name eth0
  ip -n "$ns" addr add "$subnet.$((h + 1))/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  ip -n "$switch" link set "p$h" master br0
  ip -n "$switch" link set "p$h" up
  shape "$ns"
  # Each veth end hands its arrivals to one CPU per flow (RPS), as a NIC's receive queue does:
  # otherwise a flow's packets enter whichever CPU's backlog sent them (tbf releases them from
  # either CPU), arrive out of order, and TCP retransmits (measured: 800-3000 retransmitted
  # segments per a2a benchmark run at 10 Gbit/s, 0-1 with RPS).
  steer "$ns" eth0
  steer "$switch" "p$h"
done

echo "netns_hosts: $hosts hosts $subnet.1-$subnet.$hosts on one bridge, egress $rate, one-way delay $delay_said"
pids=()
for ((h = 0; h < hosts; h++)); do
  ip netns exec "${name}h$h" env HOST_INDEX=$h HOST_COUNT="$hosts" HOST_ADDR="$subnet.$((h + 1))" \
    MASTER_ADDR="$subnet.1" GLOO_SOCKET_IFNAME=eth0 LINK_RATE_BITS="$bits" \
    LINK_DELAY_APPLIED=$delay_applied "$@" \
    > >(sed -u "s/^/[host $h] /") 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || { rc=$?; ((status)) || status=$rc; }
done
exit "$status"
