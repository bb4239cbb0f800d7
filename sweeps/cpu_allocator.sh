# Sourced by the CPU sweeps: train on tcmalloc where the machine has it (Debian/Ubuntu: apt-get install
# libtcmalloc-minimal4). glibc maps and unmaps every tensor above 32 MB afresh, and every new page faults and is
# zeroed again; on a 2-core AMD EPYC a fp32 fine-tune step ran about a quarter faster on tcmalloc
# (results/bench/cpu_train/README.md). Each record states the allocator it ran on (machine.allocator).
for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4; do
  if [[ -e $lib && ${LD_PRELOAD:-} != *tcmalloc* ]]; then
    export LD_PRELOAD=$lib${LD_PRELOAD:+:$LD_PRELOAD}
    break
  fi
done
