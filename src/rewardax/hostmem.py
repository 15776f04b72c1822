"""Keeps the memory of one training step mapped for the next one on JAX's CPU backend.

XLA:CPU allocates each execution's scratch buffer (residuals, gradients: 1.6 GB for a SmolLM2
step of 4 rows x 128 tokens) with malloc and frees it at the end. glibc serves an allocation that
large with a fresh `mmap` and returns it with `munmap`, so every step first-touches all of it
again: ~390k page faults and up to a second of kernel time per step on a 2-core machine
(`benchmarks/bench_host_memory.py`). With one malloc arena, no mmap for large blocks and freed
memory never returned to the system, the next step reuses the same pages. The price: the
process keeps its peak heap size until it exits.

Where the kernel gives transparent huge pages only on request (`madvise` in
/sys/kernel/mm/transparent_hugepage/enabled, the common default), the heap is also grown once by
half the machine's memory (address space only: nothing is touched) and that range is marked
MADV_HUGEPAGE before it is freed to malloc. Every later allocation inside it is backed by 2 MiB
pages: the first step of issue #4's recipe takes ~1.4k page faults instead of ~385k, and the
steps miss the TLB less (`benchmarks/bench_quality.py` in turn with REWARDAX_HUGE_PAGES=0 on a
2-core EPYC: 159.4 s against 164.7 s of training, means of two; benchmarks/README.md). glibc's
`glibc.malloc.hugetlb=1` tunable does the same, but only when set in the environment before the
process starts.

The settings are process-wide and must be made before JAX starts its CPU backend: XLA's worker
threads take their malloc arena when they start, and a thread that has one keeps it. They are a
setting of the CPU launcher, not of the library: the `rewardax` command applies them first thing,
and nothing else does. `import rewardax`, `RewardTrainer` and the models leave the host's malloc
as they found it (it is the embedding program's, which may be a server or a notebook). A Python
program that wants them opts in with `rewardax.hostmem.retain_freed_memory()` before its first
JAX computation. Set REWARDAX_RETAIN_HOST_MEMORY=0 to keep the `rewardax` command from changing
malloc, REWARDAX_HUGE_PAGES=0 to keep the settings but not the huge-page range.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os
import platform
import sys

ENV_SWITCH = "REWARDAX_RETAIN_HOST_MEMORY"
HUGE_PAGES_SWITCH = "REWARDAX_HUGE_PAGES"
_OFF = ("0", "false", "no", "off")
# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# -1: never trim (mallopt(3)). A 2 GiB threshold, the largest positive int, still let the heap
# shrink between steps whose freed blocks added up to more (faults came back, ad hoc A/B).
_TRIM_NEVER = -1
_MADV_HUGEPAGE = 14  # asm-generic/mman-common.h
_HUGE_PAGE = 2 << 20
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_ACCELERATOR_PLUGINS = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm", "libtpu")

# "applied; ..." (what happened to huge pages), or why the settings are not in effect.
_status = "not requested yet"


def _backend_started() -> bool:
    """True once JAX has created a backend (its CPU worker threads then exist)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - a JAX without this module: assume the worst
        return True
    return bool(getattr(xla_bridge, "_backends", {"unknown": None}))


def _accelerator_expected() -> str | None:
    """Why JAX will not run on the CPU, or None when it will."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        first = platforms.split(",")[0].strip()
        return None if first == "cpu" else f"JAX_PLATFORMS={platforms}"
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(_ACCELERATOR_PLUGINS):
            return f"{name} is installed"
    return None


def retain_freed_memory() -> bool:
    """Applies the malloc settings of the module docstring, once; True if they are in effect.

    An opt-in CPU launcher setting: the `rewardax` command calls it before anything else; a Python
    program that wants the same calls it itself, first thing, e.g.

        from rewardax import hostmem
        hostmem.retain_freed_memory()  # before the first JAX computation
        import rewardax as rx  # ... then train as usual

    The whole process keeps its peak heap until it exits, so call it only where the process is a
    training job. Does nothing (returns False, reason in `status()`) when switched off by
    REWARDAX_RETAIN_HOST_MEMORY=0, when the C library is not glibc, when JAX is set to run on an
    accelerator (its device memory is not malloc's), or when a JAX backend already started.
    """
    global _status
    if _status.startswith("applied"):
        return True
    if _switched_off(ENV_SWITCH):
        _status = f"{ENV_SWITCH} is off"
        return False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        _status = "the C library is not glibc"
        return False
    accelerator = _accelerator_expected()
    if accelerator is not None:
        _status = f"JAX runs on an accelerator ({accelerator})"
        return False
    if _backend_started():
        _status = (
            "a JAX backend had already started; call rewardax.hostmem.retain_freed_memory() "
            "before the first JAX computation"
        )
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = (
        libc.mallopt(_M_ARENA_MAX, 1) == 1
        and libc.mallopt(_M_MMAP_MAX, 0) == 1
        and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_NEVER) == 1
    )
    if not ok:
        _status = "mallopt refused a setting"
        return False
    _status = f"applied; {_reserve_huge_page_heap(libc)}"
    return True


def _switched_off(variable: str) -> bool:
    return os.environ.get(variable, "1").strip().lower() in _OFF


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`), None without THP."""
    try:
        with open(_THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()


def _reserve_huge_page_heap(libc: ctypes.CDLL) -> str:
    """Grows the (never trimmed) heap by half the machine's memory, marks that range for
    transparent huge pages and frees it to malloc; says what happened. Needs the mallopt settings
    (no mmap: big blocks come from the heap; no trim: the range stays in it)."""
    if _switched_off(HUGE_PAGES_SWITCH):
        return f"no huge-page heap ({HUGE_PAGES_SWITCH} is off)"
    mode = thp_mode()
    if mode is None:
        return "no transparent huge pages (kernel without THP)"
    if mode != "madvise":
        # always: every large anonymous range gets them anyway; never: none can.
        return f"transparent huge pages '{mode}' (left to the kernel)"
    size = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    size -= size % _HUGE_PAGE
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    block = libc.malloc(size)
    if not block:
        return f"no huge-page heap ({size >> 20} MiB of address space refused)"
    start = -(-block // _HUGE_PAGE) * _HUGE_PAGE
    end = (block + size) // _HUGE_PAGE * _HUGE_PAGE
    marked = libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0
    libc.free(block)
    if not marked:
        return "no huge-page heap (madvise refused)"
    return f"{(end - start) / 2**30:.1f} GiB of heap on transparent huge pages"


def status() -> str:
    """'applied; <huge pages>', or why the settings are not in effect."""
    return _status
