#!/usr/bin/env bash
# Run a command bound to the CPUs of the NUMA node nearest this rank's GPU (torchrun's LOCAL_RANK), so that its
# threads and the host memory they first touch sit beside the GPU's PCIe root. For torchrun --no-python:
#
#   torchrun --nproc-per-node 4 --no-python benchmarks/numa_bind.sh python3 -m elbowroom train ...
#
# Without NUMA information (one node, no sysfs entry) the command runs unbound; what was chosen goes to stderr.
set -u
rank=${LOCAL_RANK:-0}
bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i "$rank" 2>/dev/null | tr 'A-F' 'a-f')
bus=${bus#0000}; bus=${bus#0000}  # nvidia-smi prints an 8-digit domain, sysfs a 4-digit one
node=$(cat "/sys/bus/pci/devices/${bus:+0000$bus}/numa_node" 2>/dev/null || echo -1)
cpus=$(cat "/sys/devices/system/node/node$node/cpulist" 2>/dev/null || true)
if [[ "$node" -ge 0 && -n "$cpus" ]] && taskset -c "$cpus" true 2>/dev/null; then
  echo "numa_bind: local rank $rank, GPU $bus, node $node, cpus $cpus" >&2
  exec taskset -c "$cpus" "$@"
fi
echo "numa_bind: local rank $rank, GPU ${bus:-?}: no NUMA node to bind to (node $node), unbound" >&2
exec "$@"
