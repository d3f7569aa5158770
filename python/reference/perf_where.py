"""Where a training run's CPU time goes, from `perf script` output of `perf record -g`.

    perf script -i RUN.data -F comm,pid,ip,sym,dso | python perf_where.py [--minus SHORT.txt --steps K]

Samples of the launchers (accel launch, torchrun's agent) are left out. Each sample of a
rank is put in one category: by the kernel path it was taken on (page faults, direct
copies between processes, sockets, scheduling) or by the user-space symbol it landed in
(matrix products, element-wise kernels, copies, the optimizer, the Python interpreter).
With --minus, the samples of a shorter run of the same program are subtracted and the
difference divided by the K extra steps: what one step costs, without start-up and loading.
Prints one JSON object: {category: samples (per step with --minus)}.
"""

import argparse
import collections
import json
import re
import sys

# (category, pattern on the frames of a kernel sample's call chain), first match wins.
KERNEL = [
    ("page faults (fresh memory zeroed and mapped)", re.compile(r"exc_page_fault|do_anonymous_page|handle_mm_fault")),
    ("freeing memory (munmap)", re.compile(r"__x64_sys_munmap|unmap_region|__vm_munmap|do_vmi_munmap")),
    ("direct copies between processes (process_vm_readv)", re.compile(r"process_vm_rw")),
    ("sockets (TCP, gloo)", re.compile(r"tcp_|sock_|inet_|unix_stream")),
    ("waiting and scheduling (futex, poll)", re.compile(r"futex|schedule|poll|epoll|nanosleep")),
    ("reading files (the checkpoint)", re.compile(r"filemap_|vfs_read|ksys_read|do_sys_open")),
]
# (category, pattern on the user-space symbol or library), first match wins.
USER = [
    ("matrix products (MKL sgemm)", re.compile(r"sgemm|mkl_blas")),
    ("optimizer (fused AdamW)", re.compile(r"fused_adam|_fused_adamw|adam")),
    ("copies (copy_, cat, memmove)", re.compile(r"direct_copy_kernel|copy_kernel|cat_serial|memmove|memcpy")),
    ("Python interpreter", re.compile(r"libpython|_PyEval|gc_collect|PyObject|visit_")),
    ("gloo", re.compile(r"gloo")),
    ("other ATen kernels", re.compile(r"libtorch_cpu|at::native|libsleef")),
    ("allocator (malloc/free)", re.compile(r"malloc|free|_int_|libc\.so")),
]


# The launchers' processes (accel launch; torchrun's agent and its thread), not the ranks.
LAUNCHERS = {"accel", "torchrun", "pt_elastic"}


def categorize(lines):
    counts = collections.Counter()
    sample = []
    launcher = False

    def flush():
        if not sample or launcher:
            sample.clear()
            return
        leaf = sample[0]
        if "[kernel" in leaf:
            frames = " ".join(sample)
            for name, pattern in KERNEL:
                if pattern.search(frames):
                    counts[name] += 1
                    break
            else:
                counts["other kernel work"] += 1
        else:
            for name, pattern in USER:
                if pattern.search(leaf):
                    counts[name] += 1
                    break
            else:
                counts["other user code"] += 1
        sample.clear()

    for line in lines:
        if line.startswith((" ", "\t")):
            sample.append(line.strip())
        else:  # a sample's header (comm pid) or the blank line after its frames
            flush()
            if line.strip():
                launcher = line.split()[0] in LAUNCHERS
    flush()
    return counts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--minus", help="perf script output of a shorter run")
    p.add_argument("--steps", type=float, default=1.0, help="extra steps of this run over --minus")
    args = p.parse_args()
    counts = categorize(sys.stdin)
    if args.minus:
        with open(args.minus) as f:
            counts.subtract(categorize(f))
    print(json.dumps({k: round(v / args.steps, 1) for k, v in counts.most_common()}))


main()
