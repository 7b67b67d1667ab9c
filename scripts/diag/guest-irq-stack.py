#!/usr/bin/env python3
"""Reads a hung x86_64 guest's RAM dump (from nested-hang.sh) against its vmlinux.

Prints the tail of the guest kernel's log buffer and, for each IRQ-entry return address found in
RAM (a frame of an interrupt taken on that stack), the kernel text addresses around it with
symbols. Two interrupt entries stacked on one IRQ stack, the inner one interrupting code that runs
with interrupts off (e.g. __hrtimer_run_queues), show an interrupt delivered while EFLAGS.IF=0.

Assumes the kernel runs where vmlinux links it (no KASLR): GPA = VA - 0xffffffff80000000 for
kernel image symbols. Usage: guest-irq-stack.py VMLINUX RAM_DUMP [MAX_ENTRIES]
"""
import bisect
import re
import struct
import subprocess
import sys

KERNEL_MAP = 0xFFFFFFFF80000000
LOG_BUF_BYTES = 1 << 17  # CONFIG_LOG_BUF_SHIFT=17 in kernel-config/x86_64.config


def symbols(vmlinux):
    """(sorted text addresses, names) and all symbols by name, from `nm -n`."""
    out = subprocess.run(["nm", "-n", vmlinux], capture_output=True, text=True, check=True).stdout
    text, by_name = [], {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) != 3:
            continue
        addr, kind, name = int(parts[0], 16), parts[1], parts[2]
        by_name[name] = addr
        if kind in "tTwW":
            text.append((addr, name))
    return [a for a, _ in text], [n for _, n in text], by_name


def main():
    vmlinux, dump = sys.argv[1], sys.argv[2]
    max_entries = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    addrs, names, by_name = symbols(vmlinux)
    lo, hi = by_name["_stext"], by_name["_etext"]

    def sym(v):
        i = bisect.bisect_right(addrs, v) - 1
        return "%s+0x%x" % (names[i], v - addrs[i])

    ram = open(dump, "rb").read()
    log_gpa = by_name["__log_buf"] - KERNEL_MAP
    print("== guest log (tail)")
    for text in re.findall(rb"[\x20-\x7e]{6,}", ram[log_gpa:log_gpa + LOG_BUF_BYTES])[-8:]:
        print("  " + text.decode())
    words = struct.unpack("<%dQ" % (len(ram) // 8), ram[: len(ram) // 8 * 8])
    entries = [i for i, w in enumerate(words)
               if lo <= w < hi and re.match(r"asm_(sysvec|common)_\w+\+0x[1-9a-f]", sym(w))]
    print("== interrupt entries found at GPAs:", ", ".join("%#x" % (i * 8) for i in entries[:16]))
    for i in entries[:max_entries]:
        print("== frames around GPA %#x" % (i * 8))
        for j in range(max(0, i - 48), min(len(words), i + 32)):
            if lo <= words[j] < hi:
                print("  %#x: %s" % (j * 8, sym(words[j])))


if __name__ == "__main__":
    main()
